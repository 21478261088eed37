"""OuterOptimizer scenarios run unchanged on the simulator and on real backends (Gloo, MPI)."""

from __future__ import annotations

from typing import Any

import torch

import gossip
import topologies
from helpers.algorithm_scenarios import local_model

STEPS = 9


def _powergossip(rank: int) -> gossip.PowerGossip:
    return gossip.PowerGossip(rank=rank, min_compression=1)


#: name -> (the algorithm, the wrapper's schedule, whether it all-reduces: equal to the simulator to rounding).
CASES: dict[str, tuple[Any, Any, bool]] = {
    "allreduce-delay1-merge": (
        lambda n: gossip.OuterOptimizer(gossip.AllReduce(), 3, delay=1, merge=0.5),
        topologies.ring,
        True,
    ),
    "exact": (lambda n: gossip.OuterOptimizer(gossip.ExactGossip(), 3), topologies.ring, False),
    "powergossip-hybrid": (
        lambda n: gossip.OuterOptimizer(_powergossip(2), 3, between=_powergossip(1)),
        topologies.one_peer_hypercube,
        False,
    ),
    "powergossip-delay1-hybrid": (
        lambda n: gossip.OuterOptimizer(_powergossip(1), 3, delay=1, merge=0.5, between=_powergossip(2)),
        topologies.one_peer_hypercube,
        False,
    ),
    "exact-delay2-hybrid": (
        lambda n: gossip.OuterOptimizer(gossip.ExactGossip(), 4, delay=2, merge=0.5, between=gossip.ExactGossip()),
        topologies.ring,
        False,
    ),
    "own-schedule-hybrid": (
        lambda n: gossip.OuterOptimizer(
            gossip.ExactGossip(), 3, between=_powergossip(1), schedule=topologies.one_peer_hypercube(n)
        ),
        topologies.ring,
        False,
    ),
}


def run_case(comm: gossip.Communicator, name: str) -> dict[str, Any]:
    """``STEPS`` steps of ``name`` on bare buckets, a rank- and step-seeded local update after each; every step's
    replica, the anchors at the end and the bytes booked against the communicator's counters."""
    make, schedule, _ = CASES[name]
    buckets = local_model(comm.rank)
    before = dict(comm.bytes_sent)
    algorithm = make(comm.size)
    algorithm.setup(comm, schedule(comm.size), buckets)
    replicas = []
    for step in range(STEPS):
        algorithm.step(step)
        replicas.append(torch.cat([b.buffer for b in buckets]).clone())
        generator = torch.Generator().manual_seed(1000 * comm.rank + step)
        for bucket in buckets:
            bucket.buffer.add_(0.01 * torch.randn(bucket.buffer.shape, generator=generator))
    algorithm.drain()
    return {
        "replicas": replicas,
        "theta": [t.clone() for t in algorithm.synchronised()],
        "sent": dict(algorithm.traffic.sent),
        "comm_sent": {p: b - before.get(p, 0) for p, b in comm.bytes_sent.items() if b != before.get(p, 0)},
    }


def run_all(comm: gossip.Communicator) -> dict[str, Any]:
    return {name: run_case(comm, name) for name in CASES}
