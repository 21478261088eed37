"""A module of this repository as it was at an earlier git revision, loaded beside the current code.

The benchmarks time a previous implementation against the current one in the same process: ``git show
REV:path`` into a temporary file, imported under its own module name so that both versions coexist.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_at_revision(
    relative_path: str,
    revision: str,
    name: str,
    file: str | None = None,
    adapt: Callable[[str], str] | None = None,
) -> types.ModuleType:
    """``relative_path`` (e.g. ``gossip/algorithms/powergossip.py``) as it was at git ``revision``, imported as
    module ``name``; or the given ``file`` instead, where no git history is at hand. ``adapt`` rewrites the source
    first, for an interface of the current code that the old module predates."""
    if file is None or adapt is not None:
        if file is None:
            source = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{revision}:{relative_path}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        else:
            source = Path(file).read_text()
        if adapt is not None:
            source = adapt(source)
        file = str(Path(tempfile.mkdtemp()) / f"{name}.py")
        Path(file).write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
