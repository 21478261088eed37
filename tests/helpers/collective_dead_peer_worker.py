"""Worker for tests/test_lifecycle.py: rank 2 SIGKILLs itself while the others wait in an all_reduce.

Usage: mpiexec -disable-auto-cleanup -n 4 python tests/helpers/collective_dead_peer_worker.py OUT_DIR (MPI, a sum), or
with torchrun-style variables ``... OUT_DIR gloo`` (Gloo, an average: a sum, then a division). Each survivor writes
the error it ends with to ``OUT_DIR/rank<r>.err`` (Hydra's own output may end before the survivors do), then lets it
reach the top level: a traceback and exit status 1.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

import gossip

backend = sys.argv[2] if len(sys.argv) > 2 else "mpi"
comm = gossip.init(backend, timeout=20.0)
comm.barrier()
if comm.rank == 2:
    time.sleep(1.0)  # the others are in the all_reduce by now (or, on Gloo, refused at its post: named alike)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    comm.all_reduce(torch.ones(3), "sum" if backend == "mpi" else "avg")
except Exception as error:
    (Path(sys.argv[1]) / f"rank{comm.rank}.err").write_text(f"{type(error).__name__}: {error}")
    raise
