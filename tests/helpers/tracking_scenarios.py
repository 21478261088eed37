"""Gradient tracking with compressed (PowerGossip, scaled-sign) trackers: scenarios run unchanged on the simulator
and on real backends (Gloo, MPI)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gossip
import optim
import topologies
from gossip.wrapper.peer_agreement import MESSAGE_BYTES
from helpers.parallel_scenarios import batch, checkpoint_resume, flat_parameters, loss_of, make_mlp

STEPS = 8
EPS = torch.finfo(torch.float32).eps
OVERLAPPED_POWERGOSSIP_TRACKERS = {"gradient_tracking": "powergossip", "tracking_overlap": True}


def tracker(rank: int = 1) -> gossip.PowerGossip:
    """The trackers' PowerGossip: every matrix compressed (the MLP's are small)."""
    return gossip.PowerGossip(rank=rank, min_compression=1)


def tracked_steps(
    comm,
    algorithm: str = "exact",
    tracking: Any = None,
    steps: int = STEPS,
    overlap: bool = False,
    schedule: str = "one_peer_hypercube",
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
    mean_gradient: str = "gossip",
    hops: int = 1,
    keep_model: bool = False,
) -> list[dict]:
    """SGD (or ``optimizer_factory``'s optimizer) with gradient tracking (``tracking``; default: PowerGossip
    trackers) on the built-in ``schedule`` (``overlap``: the overlapped, combine-then-adapt form); after every step:
    this rank's tracker y, what it tracks (g^t, or the first moment for a momentum source), its ``.grad``, x,
    the bytes the step sent and, for :class:`optim.MomentumTrackingAdamW`, its first moment h. ``hops``: the
    wrapper's ``tracker_hops``; ``keep_model``: the closed wrapper is appended after the rows."""
    make = {"exact": gossip.ExactGossip, "powergossip": lambda: gossip.PowerGossip(rank=1, min_compression=1)}
    model = gossip.DecentralizedDataParallel(
        make_mlp(comm.rank),
        comm,
        topologies.by_name(schedule, comm.size),
        make[algorithm](),
        gradient_tracking=tracking or tracker(),
        tracking_overlap=overlap,
        tracker_hops=hops,
        mean_gradient=mean_gradient,
    )
    make_optimizer = optimizer_factory or (lambda parameters: torch.optim.SGD(parameters, lr=0.05))
    optimizer = make_optimizer(model.parameters())
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
        if isinstance(optimizer, optim.MomentumTrackingAdamW):  # its first moment h_i
            rows[-1]["h"] = torch.cat([optimizer.state[p]["h"].reshape(-1) for p in model.parameters()]).clone()
        optimizer.zero_grad()
    model.close()
    return [*rows, model] if keep_model else rows


def assert_trackers_sum_to_the_gradients(per_rank: list[list[dict]], optimizer_sees_trackers: bool = True) -> None:
    """After every step of :func:`tracked_steps`, sum_i y_i = sum_i g_i up to float32 rounding, and (unless told
    otherwise) the optimizer stepped on y_i: ``.grad`` holds it bit for bit.

    The bound: each step's update y + g - g_prev and the mixing round every term once (relative eps each, at most
    n + 2 roundings per coordinate per step), and the error of the sum accumulates over the steps so far; that many
    eps times the largest magnitude involved.
    """
    n = len(per_rank)
    for step in range(len(per_rank[0])):
        y = torch.stack([rows[step]["y"] for rows in per_rank]).double()
        g = torch.stack([rows[step]["g"] for rows in per_rank]).double()
        scale = max(y.abs().max().item(), g.abs().max().item())
        tolerance = (step + 1) * (n + 2) * n * EPS * scale
        gap = (y.sum(0) - g.sum(0)).abs().max().item()
        assert gap <= tolerance, f"step {step}: |sum y - sum g| = {gap:.3g} > {tolerance:.3g}"
        if optimizer_sees_trackers:
            for rank, rows in enumerate(per_rank):
                assert torch.equal(rows[step]["grad"], rows[step]["y"]), f"step {step} rank {rank}"


def momentum_tracking_adamw(parameters: Any, every: int = 2) -> optim.MomentumTrackingAdamW:
    """Momentum tracking's optimizer, sampling the mean gradient's second moment every ``every`` steps (0: each
    rank's own)."""
    return optim.MomentumTrackingAdamW(parameters, lr=1e-2, betas=(0.9, 0.95), second_moment_every=every)


def tracker_momentum_tracking_adamw(parameters: Any, **kwargs: Any) -> optim.MomentumTrackingAdamW:
    """Momentum tracking's optimizer with the second moment read off the tracker (``second_moment="tracker"``)."""
    return optim.MomentumTrackingAdamW(parameters, lr=1e-2, betas=(0.9, 0.95), second_moment="tracker", **kwargs)


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
        "sign": tracked_steps(comm, "powergossip", "sign"),
        "sign-checkpoint": checkpoint_resume(
            comm, directory / "sign", gossip.PowerGossip, False, gradient_tracking="sign"
        ),
        "sign-two-hops": tracked_steps(comm, "powergossip", "sign", hops=2),
        "sign-two-hops-checkpoint": checkpoint_resume(
            comm, directory / "sign-two-hops", gossip.PowerGossip, False, gradient_tracking="sign", tracker_hops=2
        ),
        "momentum": tracked_steps(comm, "powergossip", True, optimizer_factory=momentum_tracking_adamw),
        "momentum-own-v": tracked_steps(
            comm, "powergossip", True, optimizer_factory=lambda parameters: momentum_tracking_adamw(parameters, 0)
        ),
        "momentum-checkpoint": checkpoint_resume(
            comm,
            directory / "momentum",
            gossip.PowerGossip,
            False,
            optimizer_factory=momentum_tracking_adamw,
            gradient_tracking=True,
        ),
    }


def comparison_bytes(schedule_name: str, n: int, rank: int, steps: int) -> list[int]:
    """The bytes of the optimizers' comparison with the peers (:mod:`gossip.wrapper.peer_agreement`) in each of
    ``steps`` steps of a tracking run whose first optimizer step is step 0: one message to each out-peer at steps
    1 .. len(check_steps)."""
    schedule = topologies.by_name(schedule_name, n)
    window = range(1, 1 + len(schedule.check_steps))
    return [MESSAGE_BYTES * len(schedule.peers(rank, t).out_peers) if t in window else 0 for t in range(steps)]
