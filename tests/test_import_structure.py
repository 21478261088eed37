"""The import structure of the library: it never imports the main job, and its modules import each other without a
cycle.

The library is every module of ``gossip`` (outside ``gossip.app``, the main job, and ``gossip/__main__.py``, the
``python -m gossip`` entry point that forwards to it), ``optim`` and ``topologies``. The checks read the source with
:mod:`ast`, so an import inside a function counts like one at the top of a module; only imports under
``if TYPE_CHECKING:`` (never executed) are left out. A cycle is found with :func:`networkx.find_cycle` on the graph
module -> module it imports; the same check covers experiments/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parent.parent
LIBRARY_PACKAGES = ("gossip", "optim", "topologies")
APPLICATION = "gossip.app"
ENTRY_POINTS = ("gossip.__main__",)  # forwards to the application by design


def module_name(path: Path, root: Path) -> str:
    """``gossip/algorithms/base.py`` -> ``gossip.algorithms.base``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    return {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` at any depth, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        children = list(ast.iter_child_nodes(node))
        if _is_type_checking_block(node):
            children = list(node.orelse)
        stack.extend(children)
    return found


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (the file ``path``) imports: ``import a.b`` -> ``a.b``;
    ``from a import b`` -> ``a.b`` when that is a module, else ``a``; relative imports resolved against ``module``."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        found.update(target for target in targets if target in known)
    found.discard(module)
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> nx.DiGraph:
    """Directed graph: an edge ``a -> b`` when module ``a`` imports module ``b`` (both in ``packages``)."""
    modules = package_modules(root, packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        graph.add_edges_from((module, target) for target in imported_modules(module, path, set(modules)))
    return graph


def import_cycle(graph: nx.DiGraph) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    try:
        edges = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return None
    return [source for source, _ in edges] + [edges[0][0]]


def library_imports_of_application(root: Path) -> dict[str, list[str]]:
    """``{library module: [application modules it imports]}`` for every library module that imports the main job."""
    graph = import_graph(root, LIBRARY_PACKAGES)
    offending = {}
    for module in graph:
        if module == APPLICATION or module.startswith(APPLICATION + ".") or module in ENTRY_POINTS:
            continue
        targets = sorted(t for t in graph.successors(module) if t == APPLICATION or t.startswith(APPLICATION + "."))
        if targets:
            offending[module] = targets
    return offending


def test_no_library_module_imports_the_application():
    assert library_imports_of_application(REPO) == {}, (
        f"library modules import the main job ({APPLICATION}); move the shared piece into the library"
    )


def test_the_library_imports_form_no_cycle():
    graph = import_graph(REPO, LIBRARY_PACKAGES)
    assert graph.number_of_edges() > 50, "the import graph was not read (no edges found)"
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; move the shared piece into the module that owns it"


def test_the_experiments_imports_form_no_cycle():
    """The runtime model's modules import one way (costs <- model <- cli <- validate), and so does the rest."""
    graph = import_graph(REPO, ("experiments",))
    assert graph.has_edge("experiments.runtime_model.cli", "experiments.runtime_model.model")
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; move the shared piece into the module that owns it"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checks_find_a_cycle_through_a_lazy_import_and_an_import_of_the_application(tmp_path):
    _write(
        tmp_path,
        {
            "gossip/__init__.py": "",
            "gossip/app/__init__.py": "",
            "gossip/app/train.py": "from gossip.wrapper import metrics\n",
            "gossip/wrapper/__init__.py": "",
            "gossip/wrapper/metrics.py": "def f():\n    from ..app import train\n",
            "gossip/__main__.py": "from gossip.app.train import f\n",
            "optim/__init__.py": "",
            "topologies/__init__.py": "",
            "topologies/schedule.py": "def check():\n    from topologies.validation import find\n",
            "topologies/validation.py": "from typing import TYPE_CHECKING\nfrom topologies.schedule import Error\n"
            "if TYPE_CHECKING:\n    from gossip.app import train\n",
        },
    )
    # ``from ..app import train`` inside a function of gossip/wrapper/metrics.py resolves to gossip.app.train.
    assert library_imports_of_application(tmp_path) == {"gossip.wrapper.metrics": ["gossip.app.train"]}
    graph = import_graph(tmp_path, LIBRARY_PACKAGES)
    assert not graph.has_edge("topologies.validation", "gossip.app.train")  # TYPE_CHECKING only
    cycles = sorted(sorted(cycle) for cycle in nx.simple_cycles(graph))
    assert cycles == [["gossip.app.train", "gossip.wrapper.metrics"], ["topologies.schedule", "topologies.validation"]]
    assert import_cycle(graph) is not None
