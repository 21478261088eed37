"""The documentation can be followed: every pointer it makes resolves inside the repository.

* docs/ARCHITECTURE.md names modules in backticks, either dotted (`gossip.wrapper.parallel`, `gossip.simulate`:
  imported, then attributes looked up) or as paths (`gossip/algorithms/base.py`: the file exists). Other backticked text
  (code such as `optimizer.step()`) is not a name of this repository and is left alone.
* Code and docs point at the design notes as ``docs/design.md <label>`` (``A.8``, ``B.1-B.6``, ``F.3/F.4``,
  ``B.1 and G``, ``section H``, ``R4``); every label must be a heading of docs/design.md.
* Nothing points at the research notes the design notes replaced, which live outside the repository.
* The options table of the main job's page (docs/guide/main-job.md) states the main job's defaults.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
MAIN_JOB = REPO / "docs" / "guide" / "main-job.md"

# Built from pieces so that this file does not match itself.
FORBIDDEN = ("algorithms" + ".md", ".." + "/shared", "shared" + "/research")
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build", "dist", "runs"}

# A section label: a capital letter, optionally followed by digits (R4), a prime (A') or dotted numbers (A.12).
LABEL = r"[A-Z](?:\d+|'|(?:\.\d+)+)?(?![A-Za-z0-9])"
HEADING = re.compile(rf"^#{{2,4}}\s+({LABEL})[.\s]", re.MULTILINE)
POINTER = re.compile(
    rf"docs/design\.md[ \t]+(?:section[ \t]+|§)?({LABEL}(?:(?:[ \t]*[,/-][ \t]*|[ \t]+and[ \t]+){LABEL})*)"
)
PROJECT_PACKAGES = ("gossip", "optim", "topologies", "experiments", "benchmarks", "tests")
DOTTED = re.compile(rf"(?:{'|'.join(PROJECT_PACKAGES)})(?:\.\w+)*(?:\(\))?")

REQUIRED_LABELS = (
    ["A", "A'", "B", "C", "D", "E", "F", "G", "H"]
    + [f"A.{i}" for i in range(1, 13)]
    + [f"B.{i}" for i in range(1, 7)]
    + [f"C.{i}" for i in range(1, 5)]
    + [f"D.{i}" for i in range(1, 4)]
    + ["E.1", "E.2"]
    + [f"F.{i}" for i in range(1, 6)]
    + [f"R{i}" for i in range(1, 15)]
)


def design_labels(text: str) -> set[str]:
    """The section labels that head a section of the design notes."""
    return set(HEADING.findall(text))


def pointed_labels(text: str) -> list[str]:
    """Every label a ``docs/design.md <label>[, <label> ...]`` pointer in ``text`` names."""
    return [label for group in POINTER.findall(text) for label in re.findall(LABEL, group)]


def dangling_pointers(text: str, labels: set[str]) -> list[str]:
    return [label for label in pointed_labels(text) if label not in labels]


def resolve(dotted: str) -> Any:
    """Import the longest importable module prefix of ``dotted`` and look the rest up as attributes."""
    parts = dotted.removesuffix("()").split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: ModuleType | Any = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                continue  # this prefix is not a module: try a shorter one
            raise
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


def named_in_architecture(text: str) -> tuple[list[str], list[str]]:
    """(paths, dotted names) written in backticks in docs/ARCHITECTURE.md."""
    quoted = re.findall(r"`([^`\s]+)`", text)
    paths = [q for q in quoted if "/" in q and not q.startswith(("http", "@"))]
    dotted = [q for q in quoted if "/" not in q and DOTTED.fullmatch(q)]
    return paths, dotted


def unresolved(paths: list[str], dotted: list[str]) -> list[str]:
    missing = [path for path in paths if not (REPO / path).exists()]
    for name in dotted:
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name} ({type(error).__name__}: {error})")
    return missing


def repository_files() -> list[Path]:
    """The repository's files: what git tracks or would track (ignored paths left out); without git, a walk."""
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                cwd=REPO,
                capture_output=True,
                check=True,
                timeout=60,
            )
            .stdout.decode()
            .split("\0")
        )
        return sorted(REPO / name for name in listed if name and (REPO / name).is_file())
    except (OSError, subprocess.SubprocessError):
        pass
    found = []
    for path in sorted(REPO.rglob("*")):
        relative = path.relative_to(REPO).parts
        if any(part in SKIPPED_DIRS or part.endswith(".egg-info") or part.startswith(".") for part in relative[:-1]):
            continue
        if any((REPO.joinpath(*relative[:i]) / "pyvenv.cfg").exists() for i in range(1, len(relative))):
            continue
        if path.is_file():
            found.append(path)
    return found


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def labels() -> set[str]:
    return design_labels(DESIGN.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    texts = {str(path.relative_to(REPO)): text_of(path) for path in repository_files()}
    return {name: text for name, text in texts.items() if text is not None}


def test_design_notes_keep_every_section_label_the_code_was_written_against(labels):
    assert not [label for label in REQUIRED_LABELS if label not in labels]


def test_every_design_pointer_in_code_and_docs_names_an_existing_section(labels, sources):
    checked = {name: text for name, text in sources.items() if name.endswith((".py", ".md"))}
    dangling = {name: dangling_pointers(text, labels) for name, text in checked.items()}
    assert not {name: found for name, found in dangling.items() if found}, "pointers to missing sections"
    # The pattern must actually find the pointers (about 60 in code, tests, experiments and the READMEs).
    assert sum(len(pointed_labels(text)) for text in checked.values()) >= 50


def test_a_pointer_to_a_missing_section_is_reported(labels):
    notes = "docs/design" + ".md"  # built from pieces: this file's own text is checked like any other
    text = f"see {notes} A.8 and {notes} B.1-B.9; {notes} section Z, {notes} F.3/F.44"
    assert dangling_pointers(text, labels) == ["B.9", "Z", "F.44"]


def test_no_file_points_at_notes_outside_the_repository(sources):
    offending = {name: [s for s in FORBIDDEN if s in text] for name, text in sources.items()}
    assert not {name: found for name, found in offending.items() if found}


def test_every_module_and_file_named_in_the_architecture_page_exists():
    paths, dotted = named_in_architecture(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(paths) >= 30 and len(dotted) >= 10, "the page names its modules in backticks"
    assert unresolved(paths, dotted) == []


def test_a_missing_module_or_file_in_the_architecture_page_is_reported():
    paths, dotted = named_in_architecture(
        "`gossip/nowhere.py` `gossip.algorithms.Nowhere` `gossip.nowhere` `gossip.wrapper.parallel` `optimizer.step()`"
    )
    assert dotted == ["gossip.algorithms.Nowhere", "gossip.nowhere", "gossip.wrapper.parallel"]
    assert [entry.split(" ")[0] for entry in unresolved(paths, dotted)] == [
        "gossip/nowhere.py",
        "gossip.algorithms.Nowhere",
        "gossip.nowhere",
    ]


def main_job_option_defaults() -> dict[str, str]:
    """The options table of the main job's page (docs/guide/main-job.md): option cell -> default cell."""
    rows = re.findall(r"^\| (`--[^|]+?) \| ([^|]+?) \|", MAIN_JOB.read_text(encoding="utf-8"), re.MULTILINE)
    return dict(rows)


def test_the_main_job_page_states_the_main_jobs_defaults():
    from gossip.app.train import DEFAULTS, TrainConfig

    table, config = main_job_option_defaults(), TrainConfig()
    assert table["`--power-iterations`"] == str(DEFAULTS.power_iterations)
    assert table["`--message-dtype`"] == f"`{DEFAULTS.message_dtype}`"
    assert table["`--average-every K`"].startswith(f"{DEFAULTS.average_every} ")
    assert table["`--outer-every H`"].startswith(f"{DEFAULTS.outer_every} with `exact` and `powergossip`")
    outer = table["`--local-steps H`, `--outer-lr`, `--outer-momentum`"]
    assert f"–, {DEFAULTS.outer_lr:g}, {DEFAULTS.outer_momentum:g} for a hybrid's outer step" in outer
    assert table["`--algorithm`"].startswith(
        f"`{DEFAULTS.algorithm}` (rank {DEFAULTS.rank}, {DEFAULTS.power_iterations} power iterations, "
        f"{DEFAULTS.message_dtype} messages)"
    )
    assert table["`--optimizer`"].startswith(f"`{DEFAULTS.optimizer}`")
    steps, batch, lr, seed = table["`--steps`, `--batch-size`, `--lr`, `--seed`"].split(", ")
    assert (int(steps), int(batch), float(lr), int(seed)) == (config.steps, config.batch_size, config.lr, config.seed)
