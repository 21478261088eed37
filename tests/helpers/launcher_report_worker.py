"""Worker: rank 0 waits in an exchange with rank 1, which never takes part; the test signals rank 0 as Hydra would.

Usage (by tests/test_failures_launcher_report.py): mpiexec -n 2 python tests/helpers/launcher_report_worker.py
OUT_DIR. Each rank writes its pid to ``OUT_DIR/rank<r>.pid`` and its standard error to ``OUT_DIR/rank<r>.stderr``;
rank 0 writes ``OUT_DIR/waiting`` once its exchange is posted and only its receive is left (its small send completes
eagerly, but the comm thread may not have seen it yet: the signal would then land "waiting to send"), then waits
(timeout 60 s); rank 1 sleeps until it is killed.
"""

import os
import sys
import time
from pathlib import Path

import torch

import gossip
from helpers import own_stderr


def main() -> None:
    out_dir = Path(sys.argv[1])
    own_stderr.redirect(out_dir)
    comm = gossip.init("mpi", timeout=60.0)
    (out_dir / f"rank{comm.rank}.pid").write_text(str(os.getpid()))
    own_stderr.name_by_rank(out_dir, comm.rank)
    if comm.rank == 1:
        time.sleep(120)
        return
    handle = comm.exchange([(1, torch.zeros(4))], [(1, torch.empty(4))], seq=3)
    deadline = time.monotonic() + 30
    while not handle.progress.describe().startswith("receive from peer 1") and time.monotonic() < deadline:
        time.sleep(0.01)
    (out_dir / "waiting").write_text("")
    handle.wait()


if __name__ == "__main__":
    main()
