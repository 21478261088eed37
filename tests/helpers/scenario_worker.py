"""The body of a worker process that runs scenarios on a real backend and saves this rank's results.

Used by the ``*_worker.py`` scripts that tests/helpers/launch.py starts as ``python WORKER OUT_DIR BACKEND``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gossip


def run_scenarios(run: Callable[[gossip.Communicator, Path], Any], timeout: float = 60.0) -> None:
    """Open the backend named on the command line, ``run(comm, out_dir)``, close it, save to OUT_DIR/rank<r>.pt."""
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    comm = gossip.init(backend, timeout=timeout)
    results = run(comm, out_dir)
    comm.close()
    torch.save(results, out_dir / f"rank{comm.rank}.pt")
