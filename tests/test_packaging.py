"""What a plain ``pip install gossip-train`` gives: metadata, licence, type information, and every import covered.

``gossip-train`` must run after a plain install, so every third-party module the packages import is a core
requirement, except the optional backends/outputs (mpi4py, tensorboard), which are imported only inside the
functions that need them and have their own extras.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import importlib.resources
import sys
from pathlib import Path

import pytest

import gossip

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("gossip", "optim", "topologies")
OPTIONAL = {"mpi4py": "mpi", "tensorboard": "tensorboard"}  # import name -> extra that provides it
# Modules that exist for one framework, imported only by who uses it (never by ``import gossip``): the framework's
# imports may stand at module level there, provided by the module's extra.
INTEGRATIONS = {"gossip/integrations/lightning.py": "lightning", "gossip/integrations/hf.py": "hf"}


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def _requirement_name(requirement: str) -> str:
    return requirement.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()


def _core_requirements() -> set[str]:
    return {_requirement_name(r) for r in importlib.metadata.requires("gossip-train") or [] if "extra ==" not in r}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level) for every absolute import in ``path``."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            name = node.module.split(".")[0]
            if node.module.startswith("torch.utils.tensorboard"):
                name = "tensorboard"  # torch's writer needs the tensorboard package
            found.append((name, id(node) in top_level))
    return found


def _provided_by_extra(name: str, extra: str, distributions: dict[str, list[str]]) -> bool:
    """Whether the import ``name`` comes from a distribution that ``extra`` requires (or what they require)."""
    required = {_requirement_name(r) for r in _setup_cfg()["options.extras_require"][extra].split()}
    for requirement in list(required):
        try:
            dependencies = importlib.metadata.requires(requirement) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        required |= {_requirement_name(d) for d in dependencies if "extra ==" not in d}
    provided = {d.lower().replace("_", "-") for d in distributions.get(name, [name])}
    return bool(provided & {r.replace("_", "-") for r in required})


def test_version_is_the_installed_distributions():
    assert gossip.__version__ == importlib.metadata.version("gossip-train")


def test_license_file_is_apache_2_as_the_metadata_says():
    assert _setup_cfg()["metadata"]["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_ships_py_typed(package):
    assert importlib.resources.files(package).joinpath("py.typed").is_file()
    assert _setup_cfg()["options.package_data"][package].strip() == "py.typed"


def test_every_third_party_import_is_a_core_requirement_or_a_lazy_optional_one():
    distributions = importlib.metadata.packages_distributions()
    core = _core_requirements()
    problems = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for name, at_module_level in _imports(path):
                if name in sys.stdlib_module_names or name in PACKAGES:
                    continue
                where = path.relative_to(REPO)
                if str(where) in INTEGRATIONS and _provided_by_extra(name, INTEGRATIONS[str(where)], distributions):
                    continue
                if name in OPTIONAL:
                    if at_module_level:
                        problems.append(f"{where}: optional {name} imported at module level")
                    continue
                provided_by = {d.lower() for d in distributions.get(name, [name])}
                if not provided_by & core:
                    problems.append(f"{where}: imports {name} ({sorted(provided_by)}), not a core requirement")
    assert not problems, "\n".join(problems)


def test_the_mpi_extra_does_not_pull_the_mpich_wheel_but_the_mpich_extra_does():
    extras = _setup_cfg()["options.extras_require"]
    assert {_requirement_name(r) for r in extras["mpi"].split()} == {"mpi4py"}
    assert {_requirement_name(r) for r in extras["mpich"].split()} == {"mpi4py", "mpich"}


@pytest.mark.parametrize("extra", sorted(set(INTEGRATIONS.values())))
def test_the_test_extra_installs_each_integration_extra(extra):
    extras = _setup_cfg()["options.extras_require"]
    assert set(extras[extra].split()) <= set(extras["test"].split())
