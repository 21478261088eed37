"""PowerGossip's iterations during backward (``PowerGossip.progress``): scenarios for the simulator and real backends.

Each scenario runs a step's forward, then (``wait``) waits for the step's first exchange on the handle the wrapper
holds, so that the first backward hook finds it complete on every backend and posts the second iteration there:
whether an iteration runs during backward is then decided by the handles, not by timing. Everything is seeded per
rank and step (tests/helpers/parallel_scenarios.py), so the simulator, Gloo and MPI compute the same numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.base import Algorithm
from gossip.algorithms.outer import OuterOptimizer
from gossip.algorithms.periodic import PeriodicAverage
from gossip.algorithms.powergossip import PowerGossip, PowerGossipTuning
from gossip.checkpoint import load_checkpoint, save_checkpoint
from helpers.parallel_scenarios import batch, flat_parameters, loss_of, make_mlp, wrap

STEPS = 6


def powergossip(iterations: int, during_backward: bool, message_dtype: torch.dtype | None = None) -> PowerGossip:
    """PowerGossip of rank 2 on every matrix of the test MLP, with or without iterations during backward."""
    return PowerGossip(
        rank=2,
        num_iterations=iterations,
        min_compression=1,
        message_dtype=message_dtype,
        tuning=PowerGossipTuning(iterations_during_backward=during_backward),
    )


#: Every third step is a composite's exact average (PowerGossip runs on the others).
EVERY = 3


def inside(composite: str | None, algorithm: PowerGossip) -> Algorithm:
    """``algorithm`` alone (None), as the ``between`` of the main job's outer step (``"outer"``: an exact average
    every :data:`EVERY` steps, outer lr 1, no momentum) or inside ``PeriodicAverage`` (``"periodic"``)."""
    if composite == "outer":
        return OuterOptimizer(AllReduce(), EVERY, outer_lr=1.0, outer_momentum=0.0, between=algorithm)
    if composite == "periodic":
        return PeriodicAverage(algorithm, every=EVERY)
    return algorithm


def powergossip_pending(exchange: Any) -> Any:
    """PowerGossip's part of what the wrapper's algorithm started (None on a composite's averaging step)."""
    for name in ("between", "inner"):  # OuterOptimizer's step, PeriodicAverage's gossip step
        if hasattr(exchange, name):
            return getattr(exchange, name)
    return exchange if hasattr(exchange, "handle") else None


def forward_backward(model, rank: int, step: int, wait: bool) -> None:
    """One step's forward and backward; ``wait``: for the step's first exchange in between (see the module)."""
    loss = loss_of(model, *batch(rank, step))
    pending = powergossip_pending(model._exchange)
    if wait and pending is not None:
        pending.handle.wait()
    loss.backward()


def train(
    comm,
    iterations: int,
    during_backward: bool,
    message_dtype: torch.dtype | None = None,
    wait: bool = True,
    composite: str | None = None,
) -> dict[str, Any]:
    """STEPS SGD steps (PowerGossip alone or inside ``composite``, see :func:`inside`); the parameters and how many
    iterations were posted during backward."""
    algorithm = powergossip(iterations, during_backward, message_dtype)
    model = wrap(comm, make_mlp(comm.rank), inside(composite, algorithm))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        forward_backward(model, comm.rank, step, wait)
        optimizer.step()
        optimizer.zero_grad()
    params = flat_parameters(model)
    model.close()
    return {"params": params, "ahead": algorithm.posted_ahead}


def averaged_mid_step(comm, mixed: bool) -> dict[str, Any]:
    """STEPS steps, each with ``averaged()`` (a collective) between backward and the optimizer step. ``mixed``: the
    even ranks run the second iteration during backward, the odd ones do not (the setting is not part of the
    config), so that at the collective a rank has posted an exchange its peer has not: the wrapper must let the
    peer post it first (else the peer's collective waits for one queued behind that exchange). Else: none does."""
    algorithm = powergossip(2, mixed and comm.rank % 2 == 0, torch.float16)
    model = wrap(comm, make_mlp(comm.rank), algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averages = []
    for step in range(STEPS):
        forward_backward(model, comm.rank, step, True)
        with model.averaged() as net:
            averages.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
    params = flat_parameters(model)
    model.close()
    return {"params": params, "averages": torch.stack(averages), "ahead": algorithm.posted_ahead}


def close_in_flight(comm, during_backward: bool) -> dict[str, Any]:
    """Two steps, then a third's forward and backward (its second iteration posted during backward) and close()
    without the optimizer step: close completes the step's mixing (the update skipped) on every rank."""
    algorithm = powergossip(2, during_backward)
    model = wrap(comm, make_mlp(comm.rank), algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        forward_backward(model, comm.rank, step, True)
        if step < 2:
            optimizer.step()
            optimizer.zero_grad()
    ahead = algorithm.posted_ahead
    model.close()
    return {"params": flat_parameters(model), "ahead_before_close": ahead, "steps": model.step_count}


def checkpoint_in_flight(comm, directory: str | Path) -> dict[str, Any]:
    """6 steps uninterrupted vs a checkpoint saved in step 3 after backward, with the second iteration in flight
    (posted during backward), then fresh objects, load, and steps 3-5 again."""
    directory = Path(directory) / "progress"

    def fresh(seed: int):
        model = wrap(comm, make_mlp(seed), powergossip(2, True, torch.float16))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def steps(model, optimizer, span: range) -> None:
        for step in span:
            forward_backward(model, comm.rank, step, True)
            optimizer.step()
            optimizer.zero_grad()

    model, optimizer = fresh(comm.rank)
    steps(model, optimizer, range(STEPS))
    uninterrupted = flat_parameters(model)
    model.close()

    model, optimizer = fresh(comm.rank)
    steps(model, optimizer, range(3))
    forward_backward(model, comm.rank, 3, True)
    in_flight = model.algorithm._ahead is not None and len(model.algorithm._ahead.rounds) == 2
    save_checkpoint(directory, model, optimizer)
    optimizer.step()  # the saving run goes on: its step 3 completes as if nothing had been saved
    optimizer.zero_grad()
    steps(model, optimizer, range(4, STEPS))
    continued = flat_parameters(model)
    model.close()

    model, optimizer = fresh(100 + comm.rank)
    resumed_at = load_checkpoint(directory, model, optimizer)
    steps(model, optimizer, range(resumed_at, STEPS))
    resumed = flat_parameters(model)
    model.close()
    return {
        "uninterrupted": uninterrupted,
        "continued": continued,
        "resumed": resumed,
        "resumed_at": resumed_at,
        "in_flight": in_flight,
    }


def run_all(comm, directory: Path) -> dict[str, Any]:
    """Every scenario the Gloo and MPI test compares with the simulator."""
    return {
        "float16": train(comm, 2, True, torch.float16),
        "three": train(comm, 3, True),
        "close": close_in_flight(comm, True),
        "averaged": averaged_mid_step(comm, True),
        "checkpoint": checkpoint_in_flight(comm, directory),
        "outer": train(comm, 2, True, torch.float16, composite="outer"),
    }
