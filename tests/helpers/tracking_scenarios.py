"""Gradient tracking with compressed (PowerGossip) trackers: scenarios run unchanged on the simulator and on real
backends (Gloo, MPI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import gossip
from helpers.parallel_scenarios import batch, checkpoint_resume, flat_parameters, loss_of, make_mlp, wrap

STEPS = 8
OVERLAPPED_POWERGOSSIP_TRACKERS = {"gradient_tracking": "powergossip", "tracking_overlap": True}


def tracker(rank: int = 1) -> gossip.PowerGossip:
    """The trackers' PowerGossip: every matrix compressed (the MLP's are small)."""
    return gossip.PowerGossip(rank=rank, min_compression=1)


def tracked_steps(
    comm, algorithm: str = "exact", tracking: Any = None, steps: int = STEPS, overlap: bool = False
) -> list[dict]:
    """SGD with gradient tracking (``overlap``: the overlapped, combine-then-adapt form); after every step: this
    rank's tracker y, its gradient g^t, its ``.grad``, x and the bytes the step sent."""
    make = {"exact": gossip.ExactGossip, "powergossip": lambda: gossip.PowerGossip(rank=1, min_compression=1)}
    model = wrap(
        comm, make_mlp(comm.rank), make[algorithm](), gradient_tracking=tracking or tracker(), tracking_overlap=overlap
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = []
    for step in range(steps):
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        rows.append(
            {
                "y": torch.cat([t.buffer for t in model.tracker.trackers]).clone(),
                "g": torch.cat(model.tracker.previous).clone(),
                "grad": torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone(),
                "x": flat_parameters(model),
                "bytes_sent": model.metrics.last["bytes_sent"],
            }
        )
        optimizer.zero_grad()
    model.close()
    return rows


def run_all(comm, directory: Path) -> dict[str, Any]:
    return {
        "exact": tracked_steps(comm, "exact"),
        "powergossip": tracked_steps(comm, "powergossip"),
        "checkpoint": checkpoint_resume(comm, directory, gossip.ExactGossip, False, gradient_tracking="powergossip"),
        "overlap-exact-trackers": tracked_steps(comm, "powergossip", True, overlap=True),
        "overlap-powergossip-trackers": tracked_steps(comm, "exact", overlap=True),
        "overlap-checkpoint": checkpoint_resume(
            comm,
            directory / "overlap",
            gossip.ExactGossip,
            False,
            gradient_tracking="powergossip",
            tracking_overlap=True,
        ),
    }
