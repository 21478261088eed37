"""OuterOptimizer scenarios run unchanged on the simulator and on real backends (Gloo, MPI)."""

from __future__ import annotations

import math
from typing import Any

import torch

import gossip
import topologies
from gossip.algorithms.buckets import pack
from gossip.errors import NonFiniteError
from helpers.algorithm_scenarios import local_model
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap

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


def outer_resume(comm, directory, make_algorithm, steps: int, save_at: int) -> dict[str, Any]:
    """``steps`` AdamW steps of an MLP wrapped with ``make_algorithm()`` uninterrupted, against ``save_at`` steps,
    a checkpoint, fresh objects (other initial weights), the load and the rest. Each outcome: the parameters and the
    algorithm's state_dict; ``inflight``: the synchronisation in flight when saved (None if none)."""

    def fresh(seed: int):
        model = wrap(comm, make_mlp(seed), make_algorithm())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def run(model, optimizer, span) -> tuple[torch.Tensor, dict]:
        for step in span:
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([b.buffer for b in model.buckets]).clone(), model.algorithm.state_dict()

    model, optimizer = fresh(comm.rank)
    uninterrupted = run(model, optimizer, range(steps))
    model.close()
    model, optimizer = fresh(comm.rank)
    inflight = run(model, optimizer, range(save_at))[1].get("inflight")
    gossip.save_checkpoint(directory, model, optimizer)
    model.close()
    model, optimizer = fresh(50 + comm.rank)
    resumed_at = gossip.load_checkpoint(directory, model, optimizer)
    resumed = run(model, optimizer, range(resumed_at, steps))
    model.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "resumed_at": resumed_at, "inflight": inflight}


#: Shapes of :func:`local_buckets`' tensors: a matrix and a vector.
SHAPES = [(6, 5), (7,)]


def local_buckets(rank: int) -> list:
    """Rank ``rank``'s float64 tensors of SHAPES, packed into small buckets (for an algorithm without the wrapper)."""
    generator = torch.Generator().manual_seed(100 + rank)
    named = [(f"t{i}", torch.randn(shape, generator=generator, dtype=torch.float64)) for i, shape in enumerate(SHAPES)]
    return pack(named, bucket_bytes=256)


def nan_replica_message(comm, make_algorithm, schedule: str | None = None) -> str:
    """``make_algorithm()``'s step 0 (on the built-in ``schedule``, if any) on :func:`local_buckets` with a NaN in
    rank 1's replica: the NonFiniteError's message on this rank, or "accepted"."""
    buckets, algorithm = local_buckets(comm.rank), make_algorithm()
    algorithm.setup(comm, schedule and topologies.by_name(schedule, comm.size), buckets)
    if comm.rank == 1:
        buckets[0].buffer[0] = math.nan
    try:
        algorithm.step(0)
    except NonFiniteError as error:
        return str(error)
    return "accepted"
