"""Worker: run every algorithm scenario on a real backend and save this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/algorithm_worker.py OUT_DIR BACKEND
"""

import sys
from pathlib import Path

import torch

import gossip
from helpers.algorithm_scenarios import run_all


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    comm = gossip.init(backend, timeout=60.0)
    if hasattr(comm, "_handshake"):  # torch.distributed: count the per-tensor header rounds (run_steps reads it)
        original = comm._handshake

        def counted(*args):
            comm.handshakes += 1
            return original(*args)

        comm.handshakes, comm._handshake = 0, counted
    torch.save(run_all(comm), out_dir / f"rank{comm.rank}.pt")
    comm.close()


if __name__ == "__main__":
    main()
