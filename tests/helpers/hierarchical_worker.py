"""Worker: run the hierarchical-gossip scenarios on a real backend (4 ranks = 2 nodes x 2) and save the results.

Usage (by tests/helpers/launch.py): python tests/helpers/hierarchical_worker.py OUT_DIR BACKEND. Under Gloo the launcher
sets LOCAL_WORLD_SIZE=2, so the communicator's own local size is used; MPICH on one host reports all 4 ranks as local,
so under MPI the algorithm is given ``local_size=2`` explicitly (the same node-major grouping).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import gossip
from gossip.algorithms.hierarchical import HierarchicalGossip
from helpers.algorithm_scenarios import local_model

LOCAL_SIZE = 2
CASES = {"exact": None, "powergossip-r1": 1, "powergossip-r2": 2}


def run_case(comm: gossip.Communicator, compress_rank: int | None, local_size: int | None, steps: int = 6) -> dict:
    """Mix ``steps`` steps; return the final buffers, the inner PowerGossip factors and the traffic."""
    buckets = local_model(comm.rank)
    algorithm = HierarchicalGossip(compress_rank, local_size=local_size, min_compression=1)
    algorithm.setup(comm, None, buckets)
    for step in range(steps):
        algorithm.step(step)
    edges = algorithm.inner.edges if algorithm.inner is not None else {}
    return {
        "buffers": [b.buffer.clone() for b in buckets],
        "factors": {key: [t.clone() for t in e.p + e.q] for key, e in edges.items()},
        "sent": dict(algorithm.traffic.sent),
        "received": dict(algorithm.traffic.received),
    }


def run_all(comm: gossip.Communicator, local_size: int | None = None) -> dict[str, Any]:
    return {name: run_case(comm, rank, local_size) for name, rank in CASES.items()}


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    comm = gossip.init(backend, timeout=60.0)
    local_size = None if comm.local_size == LOCAL_SIZE else LOCAL_SIZE
    torch.save({"local_size": comm.local_size, **run_all(comm, local_size)}, out_dir / f"rank{comm.rank}.pt")
    comm.close()


if __name__ == "__main__":
    main()
