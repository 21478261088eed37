"""Worker: run every communicator scenario on a real backend and save this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/comm_worker.py OUT_DIR BACKEND. BACKEND "mpi-staged" is MPI
with every tensor staged through host buffers (forced), the path GPU tensors take on an MPI that is not CUDA-aware; its
log lines are saved with the results.
"""

import logging
import os
import sys
from pathlib import Path

import torch

import gossip
from helpers.comm_scenarios import run_all


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    records: list[str] = []
    if backend == "mpi-staged":
        from gossip.backends.launch_env import detect_launch
        from gossip.backends.mpi import MPICommunicator

        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logging.getLogger("gossip").addHandler(handler)
        comm = MPICommunicator(detect_launch(), 30.0, stage=True)
    else:
        comm = gossip.init(backend, timeout=30.0)
    results = run_all(comm)
    results["log"] = records
    torch.save(results, out_dir / f"rank{comm.rank}.pt")
    comm.close()
    if backend == "gloo":
        # The failures scenario leaves a transfer stuck inside Gloo on purpose; leaving through the interpreter
        # would run Gloo's destructors on it. (MPI must leave through MPI_Finalize, which mpi4py calls at exit.)
        # Every other worker exits normally and is checked for crash messages.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
