"""Gossip-algorithm scenarios run unchanged on the simulator and on real backends (Gloo, MPI)."""

from __future__ import annotations

from typing import Any

import torch

import gossip
import topologies
from gossip.algorithms import PowerGossipTuning
from gossip.algorithms.buckets import pack

SHAPES = {"conv.weight": (8, 3, 3, 3), "fc.weight": (20, 30), "fc.bias": (20,), "head.weight": (5, 20)}


def local_model(rank: int, seed: int = 0) -> list:
    """Different tensors on every rank, in a few buckets (the small bucket size forces more than one)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    named = [(name, torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()]
    return pack(named, bucket_bytes=2048)


def make_algorithm(name: str) -> gossip.Algorithm:
    """An algorithm by name; ``pga<K>-<inner>`` is ``PeriodicAverage(<inner>, every=K)``."""
    if name.startswith("pga"):
        every, inner = name.removeprefix("pga").split("-", 1)
        return gossip.PeriodicAverage(make_algorithm(inner), every=int(every))
    return {
        "exact": lambda: gossip.ExactGossip(),
        "exact-overrelaxed": lambda: gossip.ExactGossip(gamma=1.2),
        "powergossip-r1": lambda: gossip.PowerGossip(rank=1, min_compression=1),
        "powergossip-r2-2it": lambda: gossip.PowerGossip(rank=2, num_iterations=2, min_compression=1),
        "powergossip-r2-2it-fp16": lambda: gossip.PowerGossip(
            rank=2, num_iterations=2, min_compression=1, message_dtype=torch.float16
        ),
        "powergossip-r2-2it-every": lambda: gossip.PowerGossip(
            rank=2,
            num_iterations=2,
            min_compression=1,
            tuning=PowerGossipTuning(uncompressed_every_iteration=True),
        ),
        "allreduce": lambda: gossip.AllReduce(),
        "diloco3": lambda: gossip.DiLoCo(local_steps=3),
    }[name]()


def make_schedule(name: str, n: int) -> topologies.Schedule:
    return {"hypercube": topologies.one_peer_hypercube, "ring": topologies.ring}[name](n)


def run_steps(comm: gossip.Communicator, algorithm: str, schedule: str, steps: int = 6) -> dict[str, Any]:
    """Mix for ``steps`` steps; record every step's sum over ranks, the final tensors, factors and traffic, and on
    a communicator that counts them (``handshakes``, set by algorithm_worker.py on torch.distributed) its
    per-tensor header rounds per step."""
    buckets = local_model(comm.rank)
    before = (dict(comm.bytes_sent), dict(comm.bytes_received))
    algo = make_algorithm(algorithm)
    algo.setup(comm, make_schedule(schedule, comm.size), buckets)
    sums, factors, handshakes = [], [], []
    for step in range(steps + 1):
        total = torch.cat([b.buffer.to(torch.float64) for b in buckets])
        comm.all_reduce(total)
        sums.append(total)
        if step == steps:
            break
        counted = getattr(comm, "handshakes", 0)
        algo.step(step)
        handshakes.append(getattr(comm, "handshakes", 0) - counted)
        inner = algo.inner if isinstance(algo, gossip.PeriodicAverage) else algo
        if isinstance(inner, gossip.PowerGossip):
            factors.append(
                {
                    key: (e.iteration, [p.clone() for p in e.p], [q.clone() for q in e.q])
                    for key, e in inner.edges.items()
                }
            )
    return {
        "buffers": [b.buffer.clone() for b in buckets],
        "sums": sums,
        "factors": factors,
        "handshakes": handshakes,
        "sent": dict(algo.traffic.sent),
        "received": dict(algo.traffic.received),
        "comm_sent": {p: b - before[0].get(p, 0) for p, b in comm.bytes_sent.items() if b != before[0].get(p, 0)},
        "comm_received": {
            p: b - before[1].get(p, 0) for p, b in comm.bytes_received.items() if b != before[1].get(p, 0)
        },
    }


CASES = [
    ("exact", "hypercube"),
    ("exact-overrelaxed", "ring"),
    ("powergossip-r1", "hypercube"),
    ("powergossip-r1", "ring"),
    ("powergossip-r2-2it", "hypercube"),
    ("powergossip-r2-2it-fp16", "ring"),
    ("allreduce", "hypercube"),
    ("pga3-exact", "ring"),  # PeriodicAverage: averages at steps 2 and 5 (the last), gossips in between
    ("pga3-powergossip-r2-2it", "hypercube"),
    ("diloco3", "ring"),  # DiLoCo: outer steps at steps 2 and 5 (the last), nothing sent in between
]


def run_all(comm: gossip.Communicator) -> dict[str, Any]:
    return {f"{a}/{s}": run_steps(comm, a, s) for a, s in CASES}
