"""Every exception and warning gossip defines lives in gossip.errors, in one hierarchy grouped by what the user
does about it, and docs/errors.md lists each one.

* every error class found in ``gossip`` or any of its submodules (defined there or imported) is defined in
  :mod:`gossip.errors`, derives from :class:`gossip.GossipError` and from exactly one group
  (:data:`gossip.errors.GROUPS`), except the root, the groups and the topic bases themselves;
* every warning class derives from :class:`gossip.GossipWarning` and keeps its builtin category;
* the builtin bases the classes had before the hierarchy are kept, so ``except ValueError`` still catches them;
* every name stays importable from the module it was imported from before;
* no ``raise`` in gossip's source names the root or a topic base: each error raised says what to do;
* docs/errors.md names every class, and the failure behaviour page (docs/failures.md) and the README link to it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import gossip
import gossip.errors as errors

REPO = Path(__file__).resolve().parent.parent
ERRORS_DOC = REPO / "docs" / "errors.md"
SKIPPED_MODULES = {"gossip.__main__"}  # running it is the CLI


def gossip_modules() -> list[object]:
    """gossip and every submodule that imports here (an optional dependency missing skips that module only)."""
    modules: list[object] = [gossip]
    for info in pkgutil.walk_packages(gossip.__path__, prefix="gossip."):
        if info.name in SKIPPED_MODULES:
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:
            continue
    return modules


def gossip_throwables() -> set[type[BaseException]]:
    """Every exception or warning class that gossip defines, found in any gossip module's namespace."""
    found = set()
    for module in gossip_modules():
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.split(".")[0] == "gossip"
            ):
                found.add(value)
    for name in gossip.__all__:
        value = getattr(gossip, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            found.add(value)
    return found


THROWABLES = sorted(gossip_throwables(), key=lambda cls: cls.__name__)
ERRORS = [cls for cls in THROWABLES if not issubclass(cls, Warning)]
WARNINGS = [cls for cls in THROWABLES if issubclass(cls, Warning)]
NOT_GROUPED = {errors.GossipError, *errors.GROUPS, *errors.TOPICS}

# The builtin bases each class had before the hierarchy (``except <builtin>`` must still catch it).
BUILTIN_BASES = {
    "CommTimeoutError": TimeoutError,
    "CheckpointMismatchError": ValueError,
    "ReplicaMismatchError": ValueError,
    "ConfigError": ValueError,
    "DDPBackendError": ValueError,
    "ModelChangedError": RuntimeError,
    "StepPhaseError": RuntimeError,
    "NonFiniteWarning": RuntimeWarning,
    "AverageDriftWarning": UserWarning,
    "MixingOnlyStepWarning": UserWarning,
    "ProcessGroupLeakWarning": RuntimeWarning,
}

# Where code imported each class from before gossip.errors held them all.
OLD_HOMES = {
    "ReplicaMismatchError": ["gossip.wrapper.replicas"],
    "StepPhaseError": ["gossip.wrapper.step_phase"],
    "CheckpointMismatchError": ["gossip.checkpoint", "gossip.checkpoint.agreement"],
    "AverageDriftWarning": ["gossip.wrapper.parallel"],
    "MixingOnlyStepWarning": ["gossip.wrapper.parallel"],
    "ConfigError": ["gossip.app.train"],
    "DDPBackendError": ["gossip.app.ddp_baseline"],
}


def test_the_walk_finds_the_classes() -> None:
    names = {cls.__name__ for cls in THROWABLES}
    assert {"GossipError", "ReplicaMismatchError", "StepPhaseError", "ConfigError", "AverageDriftWarning"} <= names


@pytest.mark.parametrize("cls", THROWABLES, ids=lambda cls: cls.__name__)
def test_every_class_is_defined_in_gossip_errors(cls: type[BaseException]) -> None:
    assert cls.__module__ == "gossip.errors", f"{cls.__name__} is defined in {cls.__module__}; move it to gossip.errors"
    assert getattr(errors, cls.__name__) is cls


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_is_a_gossip_error_in_exactly_one_group(cls: type[BaseException]) -> None:
    assert issubclass(cls, gossip.GossipError)
    if cls in NOT_GROUPED:
        return
    groups = [group.__name__ for group in errors.GROUPS if issubclass(cls, group)]
    assert len(groups) == 1, f"{cls.__name__} is in the groups {groups}; it must be in exactly one"


def test_the_groups_are_disjoint_bases_of_the_root() -> None:
    for group in errors.GROUPS:
        assert group.__bases__ == (gossip.GossipError,)
        assert getattr(gossip, group.__name__) is group
    for topic in errors.TOPICS:
        assert not any(issubclass(topic, group) for group in errors.GROUPS)


@pytest.mark.parametrize("cls", WARNINGS, ids=lambda cls: cls.__name__)
def test_every_warning_is_a_gossip_warning(cls: type[Warning]) -> None:
    assert issubclass(cls, gossip.GossipWarning)
    assert not issubclass(cls, gossip.GossipError)


@pytest.mark.parametrize(("name", "builtin"), sorted(BUILTIN_BASES.items()))
def test_builtin_bases_are_kept(name: str, builtin: type[BaseException]) -> None:
    assert issubclass(getattr(errors, name), builtin)


@pytest.mark.parametrize(("name", "module"), [(name, module) for name, homes in OLD_HOMES.items() for module in homes])
def test_old_import_paths_still_work(name: str, module: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_config_error_names_its_option() -> None:
    error = errors.ConfigError("--schedule", "no such schedule")
    assert (str(error), error.option) == ("--schedule: no such schedule", "--schedule")


def raised_names(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` for every ``raise Name(...)`` or ``raise Name`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name):
                found.append((node.lineno, target.id))
    return found


def test_no_raise_names_the_root_or_a_topic() -> None:
    """The root and the topic bases say nothing about what to do: every raise names a class in a group."""
    vague = {errors.GossipError.__name__, *(topic.__name__ for topic in errors.TOPICS)}
    offenders = [
        f"{path.relative_to(REPO)}:{line}: raise {name}"
        for path in sorted((REPO / "gossip").rglob("*.py"))
        for line, name in raised_names(path.read_text())
        if name in vague
    ]
    assert offenders == []


def test_docs_list_every_class_with_its_group() -> None:
    text = ERRORS_DOC.read_text()
    missing = [cls.__name__ for cls in THROWABLES if f"`{cls.__name__}`" not in text]
    assert missing == [], f"docs/errors.md does not list {missing}"
    for cls in ERRORS:
        if cls in NOT_GROUPED:
            continue
        group = next(group for group in errors.GROUPS if issubclass(cls, group))
        row = next(line for line in text.splitlines() if line.startswith(f"| `{cls.__name__}`"))
        assert f"`{group.__name__}`" in row, f"docs/errors.md's row of {cls.__name__} does not name {group.__name__}"


def test_the_failure_behaviour_page_and_the_readme_link_the_error_reference() -> None:
    assert "](errors.md)" in (REPO / "docs" / "failures.md").read_text()
    assert "](docs/errors.md)" in (REPO / "README.md").read_text()


BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(__import__("builtins")).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


@pytest.mark.parametrize(
    "folder", ["gossip/backends", "gossip/algorithms", "gossip/wrapper", "gossip/checkpoint", "gossip/app"]
)
def test_no_raise_of_a_builtin_exception(folder: str) -> None:
    """Every error raised on purpose is a gossip.errors class (its builtin base kept), never a bare builtin."""
    offenders = [
        f"{path.relative_to(REPO)}:{line}: raise {name}"
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, name in raised_names(path.read_text())
        if name in BUILTIN_EXCEPTIONS
    ]
    assert offenders == [], "raise the fitting gossip.errors class instead (e.g. InvalidArgumentError for a ValueError)"
