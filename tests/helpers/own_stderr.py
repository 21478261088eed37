"""A worker's standard error in its own file, ``OUT_DIR/rank<r>.stderr``, which the tests read instead of the
launcher's stream: MPICH's Hydra can drop the output of processes at the job's end, and its ``-l`` rank tag can land
inside a line that a process wrote in two pieces (``PeerFailedError[0] : step 7``).

A worker calls :func:`redirect` first (its rank is not known yet) and :func:`name_by_rank` once it is.
"""

import os
from pathlib import Path


def redirect(out_dir: Path) -> None:
    """Send this process's file descriptor 2 (Python's tracebacks, faulthandler, warnings) to its own file."""
    os.dup2(os.open(out_dir / f"stderr.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)


def name_by_rank(out_dir: Path, rank: int) -> None:
    """Rename this process's file to ``rank<rank>.stderr`` (the open descriptor keeps writing to it)."""
    os.replace(out_dir / f"stderr.{os.getpid()}", out_dir / f"rank{rank}.stderr")


def read(out_dir: Path, rank: int) -> str:
    """What rank ``rank`` wrote to its standard error; "" if it died before it knew its rank."""
    path = out_dir / f"rank{rank}.stderr"
    return path.read_text() if path.exists() else ""
