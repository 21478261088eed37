"""The layout explains itself.

* experiments/ holds one package per question (README.md, ``python -m experiments.<question>`` through its
  __main__.py) and, beside them, only modules that at least two questions share;
* every question's README names the command that reproduces its answer before its first sub-section, the index
  (experiments/README.md) links every question, and every relative link of those READMEs resolves (a deleted
  result a README still shows is caught here);
* results are named by configuration and seed, not by when they were made, and the committed ones stay small;
* tests/ holds only test files, with everything they share or start in the tests/helpers package.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "experiments"
PACKAGE_FILES = {"__init__.py", "README.md"}
NOT_A_QUESTION = {"__pycache__"}
TIMESTAMP = re.compile(r"\d{8}-\d{6}")
RESULTS_BUDGET_BYTES = 1_000_000  # committed files under experiments/*/results: plots and summaries, no raw runs
TESTS = REPO / "tests"
HELPERS = TESTS / "helpers"


def questions() -> list[Path]:
    return sorted(p for p in EXPERIMENTS.iterdir() if p.is_dir() and p.name not in NOT_A_QUESTION)


def top_level_modules() -> list[Path]:
    return sorted(p for p in EXPERIMENTS.glob("*.py") if p.name != "__init__.py")


def imported_modules(path: Path) -> set[str]:
    """The dotted names ``path`` imports (``import a.b`` and ``from a.b import c``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def relative_links(markdown: str) -> list[str]:
    """Targets of the Markdown links and images of ``markdown`` that point inside the repository."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [t.split("#")[0] for t in targets if not t.startswith(("http:", "https:", "mailto:", "#"))]


def first_section(markdown: str) -> str:
    """The README up to its first sub-section (``## ...``): where the answer and its command stand."""
    return re.split(r"^## ", markdown, maxsplit=1, flags=re.MULTILINE)[0]


@pytest.mark.parametrize("question", questions(), ids=lambda p: p.name)
def test_every_folder_of_experiments_is_a_question_with_its_readme_and_entry_point(question):
    assert {p.name for p in question.iterdir()} >= PACKAGE_FILES, f"{question.name}/ needs README.md and __init__.py"
    assert (question / "__main__.py").is_file(), f"python -m experiments.{question.name} needs a __main__.py"
    command = f"python -m experiments.{question.name}"
    assert command in first_section((question / "README.md").read_text(encoding="utf-8")), (
        f"{question.name}/README.md: put the answer and the command that reproduces it ({command} ...) first"
    )


def test_beside_the_questions_experiments_holds_only_shared_modules():
    stray = {p.name for p in EXPERIMENTS.iterdir() if p.is_file() and p.suffix != ".py"} - PACKAGE_FILES
    assert stray == set(), "results and notes belong to a question's folder"
    for module in top_level_modules():
        dotted = f"experiments.{module.stem}"
        users = {q.name for q in questions() for path in q.rglob("*.py") if dotted in imported_modules(path)}
        assert len(users) >= 2, f"{module.name} is used by {sorted(users)}: move it into that question's folder"


def test_the_index_links_every_question():
    linked = {Path(target).parts[0] for target in relative_links((EXPERIMENTS / "README.md").read_text())}
    assert {q.name for q in questions()} - linked == set(), "add a line per question to experiments/README.md"


@pytest.mark.parametrize("readme", sorted(EXPERIMENTS.rglob("README.md")), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_of_the_experiments_readmes_resolves(readme):
    missing = [t for t in relative_links(readme.read_text(encoding="utf-8")) if not (readme.parent / t).exists()]
    assert missing == []


def test_relative_links_and_first_section_read_markdown():
    text = "# Q\n\n`python -m experiments.q`\n![p](results/a_s0.png) [x](../b/README.md#c) [w](https://x)\n## Then\n"
    assert relative_links(text) == ["results/a_s0.png", "../b/README.md"]
    assert "python -m experiments.q" in first_section(text) and "Then" not in first_section(text)


def tracked_results() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "experiments/*/results/*"],
            cwd=REPO, capture_output=True, check=True, timeout=60,
        ).stdout.decode()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no git: the committed files are not known")
    return [REPO / name for name in sorted(set(listed.split("\0"))) if name and (REPO / name).is_file()]


def test_results_are_named_by_configuration_and_seed_not_timestamp():
    stamped = [str(p.relative_to(REPO)) for p in EXPERIMENTS.rglob("*") if TIMESTAMP.search(p.name)]
    assert stamped == []


def test_the_committed_results_stay_small():
    files = tracked_results()
    assert files, "experiments/*/results/ hold the committed plots and summaries"
    total = sum(p.stat().st_size for p in files)
    assert total < RESULTS_BUDGET_BYTES, f"{total} bytes of committed results: keep plots and summaries, not raw runs"


def test_tests_holds_test_files_and_the_helpers_package_only():
    modules = {path.name for path in TESTS.glob("*.py")}
    assert {name for name in modules if not name.startswith("test_")} == {"conftest.py"}, (
        "move scenarios, workers and launchers into tests/helpers/"
    )
    assert (HELPERS / "__init__.py").is_file()
    assert not list(HELPERS.glob("test_*.py")), "test files belong in tests/, not tests/helpers/"
