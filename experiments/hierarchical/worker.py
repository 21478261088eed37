"""One rank of the issue-8 two-level network experiment: time mixing steps of each algorithm on a model-sized
set of tensors. Started by experiments/hierarchical/study.py (usage: OUT_DIR STEPS MATRIX_SIZE LAYERS)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import gossip
import topologies
from gossip.algorithms.buckets import pack
from gossip.algorithms.hierarchical import HierarchicalGossip

METHODS = {
    "allreduce": (lambda: gossip.AllReduce(), None),
    "flat exact (one-peer hypercube)": (lambda: gossip.ExactGossip(), topologies.one_peer_hypercube),
    "flat powergossip r=4": (lambda: gossip.PowerGossip(rank=4), topologies.one_peer_hypercube),
    "hierarchical exact": (lambda: HierarchicalGossip(), None),
    "hierarchical powergossip r=4": (lambda: HierarchicalGossip(4), None),
}


def main() -> None:
    out_dir, steps, size, layers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    comm = gossip.init("gloo", timeout=300.0)
    results = {}
    for name, (make, schedule) in METHODS.items():
        generator = torch.Generator().manual_seed(comm.rank)
        named = [(f"layer{i}.weight", torch.randn(size, size, generator=generator)) for i in range(layers)]
        buckets = pack(named)
        algorithm = make()
        algorithm.setup(comm, schedule(comm.size) if schedule else None, buckets)
        algorithm.step(0)  # warm-up: connections, first-use allocations
        comm.barrier()
        started, sent = time.perf_counter(), algorithm.traffic.total_sent
        for step in range(1, steps + 1):
            algorithm.step(step)
        comm.barrier()
        seconds = (time.perf_counter() - started) / steps
        results[name] = {"seconds_per_step": seconds, "bytes_per_step": (algorithm.traffic.total_sent - sent) / steps}
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(results))
    comm.close()


if __name__ == "__main__":
    main()
