"""Worker: gradient tracking with PowerGossip-compressed trackers on a real backend; saves this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/tracking_worker.py OUT_DIR BACKEND
"""

import sys
from pathlib import Path

import torch

import gossip
from helpers.tracking_scenarios import run_all


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    comm = gossip.init(backend, timeout=60.0)
    torch.save(run_all(comm, out_dir / f"checkpoint{comm.rank}"), out_dir / f"rank{comm.rank}.pt")
    comm.close()


if __name__ == "__main__":
    main()
