"""The import structure of the library: its layers import only downward, it never imports the main job, and its
modules import each other without a cycle.

The library is every module of ``gossip`` (outside ``gossip.app``, the main job, and ``gossip/__main__.py``, the
``python -m gossip`` entry point that forwards to it), ``optim`` and ``topologies``. :data:`LAYERS` orders them (and
the main job) from the bottom up, as docs/ARCHITECTURE.md's "Layers" table does: a module may import its own layer
and the layers below it, never one above. The checks read the source with :mod:`ast`, so an import inside a function
counts like one at the top of a module; only imports under ``if TYPE_CHECKING:`` (never executed) are left out. A
cycle is found with :func:`networkx.find_cycle` on the graph module -> module it imports; the same check covers
experiments/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parent.parent
LIBRARY_PACKAGES = ("gossip", "optim", "topologies")
APPLICATION = "gossip.app"
ENTRY_POINTS = ("gossip.__main__",)  # forwards to the application by design
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"

# The layers, lowest first: (name, packages). A module belongs to the layer of the longest package that is a prefix of
# its dotted name; ``gossip`` itself names only the package's ``__init__.py``, its public names.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("topologies and optimizers", ("topologies", "optim")),  # know nothing of gossip
    ("errors", ("gossip.errors",)),  # every exception and warning, usable by every layer above
    ("communicators", ("gossip.backends",)),  # the communicators and the process bootstrap (gossip.init)
    ("algorithms", ("gossip.algorithms",)),  # the gossip algorithms and the flat parameter buckets
    ("wrapper", ("gossip.wrapper",)),  # DecentralizedDataParallel and its helpers
    ("checkpoint", ("gossip.checkpoint",)),  # save and resume of a wrapped run
    ("public names", ("gossip",)),  # gossip/__init__.py
    ("integrations", ("gossip.integrations",)),  # Lightning, HF Trainer: imported only by who uses them
    ("main job", (APPLICATION, *ENTRY_POINTS)),  # gossip-train and python -m gossip
)


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


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer, or None when no layer holds it."""
    owners = [
        (len(package), index)
        for index, (_, packages) in enumerate(LAYERS)
        for package in packages
        if module == package or (package != "gossip" and module.startswith(package + "."))
    ]
    return max(owners)[1] if owners else None


def unlayered_modules(root: Path) -> list[str]:
    """The modules of the library and the main job that no layer of :data:`LAYERS` holds."""
    return sorted(module for module in import_graph(root, LIBRARY_PACKAGES) if layer_of(module) is None)


def upward_imports(root: Path) -> list[str]:
    """Every import of a module from a higher layer than the importer's, as ``importer (layer) -> imported (layer)``."""
    graph = import_graph(root, LIBRARY_PACKAGES)
    offending = []
    for module, target in sorted(graph.edges):
        below, above = layer_of(module), layer_of(target)
        if below is not None and above is not None and above > below:
            offending.append(f"{module} ({LAYERS[below][0]}) -> {target} ({LAYERS[above][0]})")
    return offending


def documented_layers(text: str) -> list[tuple[str, ...]]:
    """The packages of each row of the table under "## Layers" in docs/ARCHITECTURE.md, in order (dotted names in
    backticks in the last column)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    return [tuple(re.findall(r"`([\w.]+)`", row.rstrip(" |").rsplit("|", 1)[1])) for row in rows]


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


def test_every_module_belongs_to_a_layer():
    assert unlayered_modules(REPO) == [], "modules outside every layer: add their package to LAYERS (lowest first)"


def test_the_layers_import_only_downward():
    """A module imports its own layer and the layers below it (:data:`LAYERS`), never one above."""
    assert len(import_graph(REPO, LIBRARY_PACKAGES).edges) > 50, "the import graph was not read (no edges found)"
    offending = upward_imports(REPO)
    assert offending == [], (
        "imports that run up the layers (importer (its layer) -> imported (a higher layer)):\n  "
        + "\n  ".join(offending)
        + "\nmove the shared piece down into the layer that both can import"
    )


def test_the_architecture_document_lists_the_same_layers():
    expected = [tuple(p for p in packages if p not in ENTRY_POINTS) for _, packages in LAYERS]
    assert documented_layers(ARCHITECTURE.read_text(encoding="utf-8")) == expected, (
        "docs/ARCHITECTURE.md's Layers table (its package column, row by row) and LAYERS disagree; update both"
    )


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


def test_the_layering_check_names_an_upward_import_and_a_module_outside_every_layer(tmp_path):
    _write(
        tmp_path,
        {
            "gossip/__init__.py": "from gossip.wrapper.parallel import Wrapper\n",
            "gossip/errors.py": "",
            "gossip/backends/__init__.py": "",
            "gossip/backends/base.py": "from gossip.errors import Error\nfrom topologies import Schedule\n",
            "gossip/algorithms/__init__.py": "",
            "gossip/algorithms/base.py": "def f():\n    from ..wrapper import metrics\n",
            "gossip/wrapper/__init__.py": "",
            "gossip/wrapper/metrics.py": "from gossip.backends import base\n",
            "gossip/wrapper/parallel.py": "from gossip import errors\nfrom gossip.wrapper import metrics\n",
            "gossip/loose.py": "",
            "optim/__init__.py": "",
            "topologies/__init__.py": "from gossip.backends.base import Communicator\n",
        },
    )
    assert upward_imports(tmp_path) == [
        "gossip.algorithms.base (algorithms) -> gossip.wrapper.metrics (wrapper)",
        "topologies (topologies and optimizers) -> gossip.backends.base (communicators)",
    ]
    assert unlayered_modules(tmp_path) == ["gossip.loose"]
    assert layer_of("gossip") == 6 and layer_of("gossip.algorithms") == 3 and layer_of("gossip.__main__") == 8


def test_the_layers_of_the_architecture_document_are_read_row_by_row():
    """Only the last column counts, and only dotted names in it (``experiments/`` is a folder, not a layer)."""
    table = "| layer | what | package |\n|---|---|---|\n| a | `x.y` | `topologies`, `optim` |\n"
    table += "| b | | `gossip`, `experiments/` |"
    text = f"## Layers\n\nSee `gossip.errors`.\n\n{table}\n\n## Next\n\n| x | `y` |\n"
    assert documented_layers(text) == [("topologies", "optim"), ("gossip",)]


FRAMEWORKS = ("pytorch_lightning", "lightning", "lightning_fabric", "transformers", "accelerate")


def framework_imports(root: Path) -> list[str]:
    """Every import of a training framework (:data:`FRAMEWORKS`) by a library module outside gossip.integrations."""
    found = []
    for module, path in package_modules(root, LIBRARY_PACKAGES).items():
        if module == "gossip.integrations" or module.startswith("gossip.integrations."):
            continue
        for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{module} -> {name}" for name in names if name.split(".")[0] in FRAMEWORKS and not node.level]
    return found


def test_only_the_integrations_import_a_training_framework():
    """``import gossip`` never imports Lightning, transformers or Accelerate: only gossip.integrations.* do."""
    assert framework_imports(REPO) == []
