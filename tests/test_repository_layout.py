"""The layout explains itself: the file table of experiments/README.md names every script, package and folder of
experiments/ (and each row names something that exists); tests/ holds only test files, with everything they share
or start in the tests/helpers package."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "experiments"
NOT_LISTED = {"__init__.py", "README.md", "__pycache__"}
TESTS = REPO / "tests"
HELPERS = TESTS / "helpers"


def table_names(readme: str) -> set[str]:
    """The backticked names in the first column of the README's first table (``| `a.py`, `b/` | ... |``)."""
    rows = [line for line in readme.split("\n\n", 3)[2].splitlines() if line.startswith("| `")]
    return {name.rstrip("/") for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def test_the_readme_table_lists_every_file_of_experiments():
    present = {path.name for path in EXPERIMENTS.iterdir() if path.name not in NOT_LISTED}
    listed = table_names((EXPERIMENTS / "README.md").read_text())
    assert present - listed == set(), "add these to the file table at the top of experiments/README.md"
    assert listed - present == set(), "the file table of experiments/README.md names files that do not exist"


def test_table_names_reads_the_first_column_only():
    readme = "# T\n\nintro\n\n| file | what |\n|---|---|\n| `a.py`, `b/` | uses `c.py` |\n| `d.py` | x |\n\n## S\n"
    assert table_names(readme) == {"a.py", "b", "d.py"}


def test_tests_holds_test_files_and_the_helpers_package_only():
    modules = {path.name for path in TESTS.glob("*.py")}
    assert {name for name in modules if not name.startswith("test_")} == {"conftest.py"}, (
        "move scenarios, workers and launchers into tests/helpers/"
    )
    assert (HELPERS / "__init__.py").is_file()
    assert not list(HELPERS.glob("test_*.py")), "test files belong in tests/, not tests/helpers/"
