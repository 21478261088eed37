"""Worker: run every DecentralizedDataParallel scenario on a real backend and save this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/parallel_worker.py OUT_DIR BACKEND
"""

import sys
from pathlib import Path

import torch

import gossip
from helpers.parallel_scenarios import make_mlp, run_all, wrap


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    comm = gossip.init(backend, timeout=30.0)
    results = run_all(comm, out_dir)
    comm.close()
    try:  # a closed communicator must be refused at once, without waiting for the peers
        wrap(comm, make_mlp(comm.rank))
        results["closed"] = "no error"
    except gossip.GossipError as error:
        results["closed"] = str(error)
    torch.save(results, out_dir / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main()
