"""Docstrings state the contract and the math, in the Google style the API pages render (issue 29, item 2).

For every package in ``PACKAGES`` the test walks every module (``pkgutil.walk_packages``) and collects the public
API: each class and function whose name has no leading underscore and that the module defines itself (objects
imported from elsewhere, such as ``torch.optim.SGD`` that ``optim`` re-exports, are documented where they are
defined), and each public method and property a public class defines itself. For each it asserts:

* a docstring of its own whose first line is a one-line summary (followed by a blank line or nothing);
* ``Args:`` naming every parameter except ``self`` / ``cls``, and naming no parameter the callable lacks; a class's
  ``Args:`` are its ``__init__``'s when the class defines one;
* a dataclass has ``Attributes:`` naming every field;
* functions and methods annotate their return: ``Returns:`` (``Yields:`` for an iterator) when it is not ``None``,
  neither when it is ``None``; properties are documented as attributes, so they need neither;
* ``Raises:`` names every exception the callable (for a class, its ``__init__``) raises itself, i.e. every
  ``raise Name(...)`` in its own body. Exceptions that arrive from a helper cannot be found this way and are listed
  by hand;
* no measurement: see ``MEASUREMENT`` below. Module docstrings are held to this rule too.

The measurement rule. A docstring may hold constants that define behaviour (defaults such as ``lr=1e-3``, formulas
such as ``1/(d + 1)``, exact facts of the math such as ``rho = 1 - 2/(1 + log2 n)``) but not measured outcomes,
which change when a benchmark is re-run. A measurement is recognised by what only measurements carry:

* a percentage (``3.2 %``), a spread (``±``, ``+/-``), a number of seeds or runs (``3 seeds``);
* a number with a unit of measured quantities: loss in nats, time (``ms``, ``s``, ``minutes``), memory or bytes
  (``GiB``, ``MB``, ``kB``), bandwidth (``Mbit/s``), throughput (``tokens/s``);
* a speed-up or ratio written ``1.7x`` / ``1.7×`` (a digit glued to the x; ``2 x 2`` grids are fine);
* an approximate number (``about 3300``, ``near step 800``, ``roughly 0.4``): the math is exact;
* a number in the past tense (``was 0.4``), ``loss 2.12``;
* the word ``measured`` (or ``measurement``) unless the same sentence points at where the measurement lives, a
  path under ``experiments/``, ``docs/`` or ``benchmarks/``: "measured in experiments/learning_per_step/README.md".

To cover another package, add its name to ``PACKAGES``; ``ROOTS`` checks the names a package root
exports that no package in ``PACKAGES`` defines (``gossip``'s errors and warnings).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
import textwrap
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

PACKAGES = (
    "topologies",
    "optim",
    "gossip.backends",
    "gossip.algorithms",
    "gossip.wrapper",
    "gossip.checkpoint",
    "gossip.integrations",
    "gossip.app",
)
#: Modules that need an optional dependency (an extra that the ``test`` extra installs): skipped where it is absent.
OPTIONAL = {"gossip.integrations.lightning": "pytorch_lightning", "gossip.integrations.hf": "transformers"}
# Packages whose own public names (``__all__``) are checked without walking their submodules: the names defined in
# a package of ``PACKAGES`` are checked there, the rest (``gossip``'s errors and warnings) here.
ROOTS = ("gossip",)

SECTION = re.compile(r"^(?P<name>[A-Z][A-Za-z ]*):\s*$")
# An item of a section, indented one level: "name: text", "name (type): text", "*args: text", "**options: text".
ITEM = re.compile(r"^ {4}(?P<name>\*{0,2}[A-Za-z_]\w*)(?:\s*\([^)]*\))?:(?:\s|$)")

DESCRIPTORS = (staticmethod, classmethod, property, functools.cached_property)

MEASUREMENT = {
    "a percentage": r"\d\s?%",
    "a spread": r"±|\+/-",
    "a count of seeds or runs": r"\b\d+\s+(?:seeds?|runs|trials|repeats)\b",
    "a measured unit": (
        r"\d(?:\.\d+)?\s*(?:nats?|ms|µs|ns|s|sec|seconds?|minutes?|hours?|GiB|MiB|KiB|GB|MB|kB|KB|TB"
        r"|[GMk]bit/s|[GMk]b/s|tokens/s|samples/s|it/s|FLOP/s|TFLOPS)(?![\w/])"
    ),
    "a speed-up or ratio": r"\d(?:\.\d+)?[x×](?!\w)",
    "an approximate number": r"\b(?:about|near|around|roughly|approximately|~)\s*(?:step\s+)?[-+−]?\d",
    "a number in the past tense": r"\b(?:was|were)\s+[-+−]?\d",
    "a loss value": r"\bloss(?:es)?\s+(?:of\s+)?[-+−]?\d",
    "'measured' without a pointer to where": r"\bmeasur\w*\b(?![^.]*?\b(?:experiments|docs|benchmarks)/)",
}
MEASUREMENT_RE = {what: re.compile(pattern, re.IGNORECASE) for what, pattern in MEASUREMENT.items()}


def measurements(text: str) -> list[str]:
    """Each measurement-looking passage of ``text``, as ``'<kind>: <match in context>'``."""
    found = []
    for what, pattern in MEASUREMENT_RE.items():
        for match in pattern.finditer(text):
            context = " ".join(text[max(0, match.start() - 30) : match.end() + 30].split())
            found.append(f"{what}: ...{context}...")
    return found


# ---------------------------------------------------------------- collecting the public API


def modules(package: str) -> list[ModuleType]:
    """The package and every module below it, imported."""
    root = importlib.import_module(package)
    found = [root]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        needs = OPTIONAL.get(info.name)
        if needs is None or importlib.util.find_spec(needs) is not None:
            found.append(importlib.import_module(info.name))
    return found


def public_api(package: str) -> Iterator[tuple[str, Any, type | None]]:
    """(qualified name, object, owning class or None) of each public class, function, method and property."""
    seen: set[int] = set()
    for module in modules(package):
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or id(obj) in seen:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or obj.__module__ != module.__name__:
                continue  # not a callable, or defined elsewhere (documented there)
            seen.add(id(obj))
            yield f"{module.__name__}.{name}", obj, None
            if inspect.isclass(obj):
                for member_name, member in vars(obj).items():
                    method = isinstance(member, DESCRIPTORS) or inspect.isfunction(member)
                    if method and not member_name.startswith("_"):
                        yield f"{module.__name__}.{name}.{member_name}", member, obj


def root_api(package: str) -> Iterator[tuple[str, Any, type | None]]:
    """The entries of ``public_api`` for the names ``package`` exports that no package in ``PACKAGES`` defines."""
    root = importlib.import_module(package)
    for name in root.__all__:
        obj = getattr(root, name)
        home = getattr(obj, "__module__", "") or ""
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if any(home == walked or home.startswith(f"{walked}.") for walked in PACKAGES):
            continue  # checked with the package that defines it
        yield f"{package}.{name}", obj, None
        if inspect.isclass(obj):
            for member_name, member in vars(obj).items():
                method = isinstance(member, DESCRIPTORS) or inspect.isfunction(member)
                if method and not member_name.startswith("_"):
                    yield f"{package}.{name}.{member_name}", member, obj


def root_modules(package: str) -> list[ModuleType]:
    """The root package and the modules that define the names ``root_api`` checks."""
    found = {package: importlib.import_module(package)}
    for _, obj, _ in root_api(package):
        found.setdefault(obj.__module__, importlib.import_module(obj.__module__))
    return list(found.values())


def api_ids(package: str) -> list[str]:
    return [name for name, _, _ in public_api(package)]


def api_cases() -> list[Any]:
    return [
        pytest.param(package, name, obj, owner, id=name)
        for package in PACKAGES
        for name, obj, owner in public_api(package)
    ] + [pytest.param(root, name, obj, owner, id=name) for root in ROOTS for name, obj, owner in root_api(root)]


# ---------------------------------------------------------------- reading a Google-style docstring


def sections(doc: str) -> dict[str, list[str]]:
    """Section title -> the names of its items (``Args:``, ``Raises:``, ...); free text under ``""``.

    A line one level in starts an item; a longer description continues two levels in (the renderer reads a
    wrapped line one level in as a new item). So in ``Returns:`` / ``Yields:`` (one unnamed item) a second line one
    level in is an error, and in the other sections such a line must have the ``name: description`` form.
    """
    found: dict[str, list[str]] = {"": []}
    current = ""
    for line in inspect.cleandoc(doc).splitlines():
        header = SECTION.match(line)
        if header:
            current = header["name"]
            found.setdefault(current, [])
            continue
        if line and not line.startswith(" "):
            current = ""
        if not current or not re.match(r" {4}\S", line):
            continue
        if current in ("Returns", "Yields"):
            found[current].append(line.strip())
            assert len(found[current]) == 1, f"indent the continuation of '{current}:' two levels: {line.strip()!r}"
        elif current not in ("Examples", "Example", "Note", "Notes", "Warning", "Warnings"):
            item = ITEM.match(line)
            assert item, f"'{current}:' line is neither 'name: description' nor indented two levels: {line!r}"
            found[current].append(item["name"].lstrip("*"))
    return found


def function_of(obj: Any) -> Any:
    """The function behind a method, static/class method or property."""
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if isinstance(obj, property):
        return obj.fget
    if isinstance(obj, functools.cached_property):
        return obj.func
    return obj


def parameters(func: Any, bound: bool) -> list[str]:
    """Parameter names of ``func``, without the first one when it is bound (self / cls)."""
    names = list(inspect.signature(func).parameters)
    return names[1:] if bound else names


def raised_names(func: Any) -> set[str]:
    """Names of the exceptions ``func`` raises in its own body (``raise Name(...)``, ``raise module.Name``)."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(func)))
    tree = ast.parse(source).body[0]
    found = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue  # a nested function raises when it is called, not here
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name):
                    found.add(exc.id)
                elif isinstance(exc, ast.Attribute):
                    found.add(exc.attr)
            visit(child)

    visit(tree)
    return found


def own_init(cls: type) -> Any | None:
    """The ``__init__`` a (non-dataclass) class defines itself, or None."""
    init = vars(cls).get("__init__")
    if dataclasses.is_dataclass(cls) or not inspect.isfunction(init):
        return None
    return init if init.__qualname__ == f"{cls.__qualname__}.__init__" else None


# ---------------------------------------------------------------- the checks


@pytest.mark.parametrize("package", PACKAGES)
def test_the_walk_finds_the_packages_public_api(package):
    names = api_ids(package)
    exported = getattr(importlib.import_module(package), "__all__", [])
    root = importlib.import_module(package)
    defined_here = [n for n in exported if getattr(getattr(root, n), "__module__", "").startswith(package)]
    short = {name.rsplit(".", 1)[-1] for name in names}
    assert set(defined_here) <= short, f"{package}.__all__ names missed by the walk: {set(defined_here) - short}"


@pytest.mark.parametrize(("package", "name", "obj", "owner"), api_cases())
def test_public_callable_has_a_google_docstring(package, name, obj, owner):
    func = function_of(obj)
    doc = func.__doc__ if not inspect.isclass(obj) else obj.__doc__
    assert doc and doc.strip(), f"{name} has no docstring"
    lines = inspect.cleandoc(doc).splitlines()
    assert len(lines) == 1 or not lines[1].strip(), f"{name}: the first line must be a one-line summary"
    found = sections(doc)

    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):
            fields = [field.name for field in dataclasses.fields(obj)]
            assert "Attributes" in found, f"{name} is a dataclass: document its fields under 'Attributes:'"
            assert sorted(found["Attributes"]) == sorted(fields), f"{name}: Attributes must list exactly {fields}"
        init = own_init(obj)
        args = parameters(init, bound=True) if init is not None else []
        raised = raised_names(init) if init is not None else set()
    elif isinstance(obj, (property, functools.cached_property)):
        args, raised = [], raised_names(func)
    else:
        bound = owner is not None and not isinstance(obj, staticmethod)
        args, raised = parameters(func, bound), raised_names(func)
        returned = inspect.signature(func).return_annotation
        assert returned is not inspect.Signature.empty, f"{name}: annotate the return type"
        returns_nothing = returned in (None, "None")
        iterator = isinstance(returned, str) and re.match(r"(?:\w+\.)*(?:Iterator|Generator|Iterable)\b", returned)
        kind = "Yields" if iterator else "Returns"
        if returns_nothing:
            assert "Returns" not in found and "Yields" not in found, f"{name} returns None: drop 'Returns:'"
        else:
            assert kind in found, f"{name} returns {returned}: add a '{kind}:' section"

    if args:
        assert "Args" in found, f"{name} takes {args}: add an 'Args:' section"
        assert sorted(found["Args"]) == sorted(args), f"{name}: 'Args:' must name exactly {args}"
    else:
        assert "Args" not in found, f"{name} takes no arguments: drop 'Args:'"
    missing = raised - set(found.get("Raises", []))
    assert not missing, f"{name} raises {sorted(missing)}: list them under 'Raises:'"


@pytest.mark.parametrize(("package", "name", "obj", "owner"), api_cases())
def test_public_docstring_holds_no_measurement(package, name, obj, owner):
    doc = obj.__doc__ if inspect.isclass(obj) else function_of(obj).__doc__
    found = measurements(doc or "")
    assert not found, f"{name}: move measurements to experiments/ or docs/ and point there by path: {found}"


@pytest.mark.parametrize(
    "module",
    [m for p in PACKAGES for m in modules(p)] + [m for r in ROOTS for m in root_modules(r)],
    ids=lambda m: m.__name__,
)
def test_module_docstring_holds_no_measurement(module):
    found = measurements(module.__doc__ or "")
    assert not found, f"{module.__name__}: move measurements to experiments/ or docs/ and point there: {found}"


@pytest.mark.parametrize(
    "text",
    [
        "it is 0.33 nats behind AdamW",
        "the computation takes 3.2 % of forward + backward",
        "one step takes 138 ms",
        "a step takes 1.5 s on this machine",
        "peak memory 1.5 GiB",
        "51.7 kB per step",
        "at 100 Mbit/s",
        "ends +0.236 ± 0.081 above DDP",
        "3 seeds, every seed",
        "1.7x faster than DDP",
        "level near step 3300",
        "it was 0.4 behind",
        "a final loss 2.12",
        "measured 0.05 ahead",
        "When it pays (measured): few samples per worker.",
    ],
)
def test_the_rule_catches_measurements(text):
    assert measurements(text), text


@pytest.mark.parametrize(
    "text",
    [
        "learning rate (default 1e-3)",
        "W_ij = 1 / (d_i + 1) for each in-neighbour",
        "For n = 2^K, rho = ||W - J||_2 = 1 - 2/(1 + log2 n).",
        "steps_to_consensus(schedule, tol=1e-6, max_steps=100_000)",
        "so 2 x 2 is the 4-ring and 2 x 4 has degree 3",
        "each in [0, 1) (default (0.9, 0.999))",
        "exact average after log2 n steps; period 2 log2(nodes)",
        "uniform star of 8 ranks: 1.06",
        "where it pays is measured in experiments/learning_per_step/README.md, its section on 16 workers.",
        "gamma* = 2 / (mu_min + mu_max)",
        "4 ranks per node when n / 4 is a power of two >= 2, else 2",
    ],
)
def test_the_rule_spares_defaults_formulas_and_pointers(text):
    assert not measurements(text), measurements(text)
