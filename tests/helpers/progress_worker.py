"""Worker: run PowerGossip's iterations-during-backward scenarios on a real backend and save this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/progress_worker.py OUT_DIR BACKEND
"""

import sys
from pathlib import Path

import torch

import gossip
from helpers.progress_scenarios import run_all


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    comm = gossip.init(backend, timeout=60.0)
    results = run_all(comm, out_dir)
    comm.close()
    torch.save(results, out_dir / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main()
