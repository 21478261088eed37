"""Training scenarios for DecentralizedDataParallel, run on the simulator and on real backends alike.

Everything is seeded per rank and per step with private generators (never the global RNG, which simulator ranks
share), so a scenario gives the same numbers on the simulator, on Gloo and on MPI.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import gossip
import optim
import topologies
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.checkpoint import load_checkpoint, load_dcp, save_checkpoint, save_dcp
from gossip.wrapper.parallel import DecentralizedDataParallel
from topologies.schedule import Schedule

IN, HIDDEN, OUT = 8, 16, 4
TARGET = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1234))


def make_mlp(seed: int, batch_norm: bool = False) -> nn.Sequential:
    """A small MLP initialised from ``seed`` (ranks pass different seeds: the wrapper broadcasts rank 0's)."""
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)]
    if batch_norm:
        layers.insert(1, nn.BatchNorm1d(HIDDEN))
    model = nn.Sequential(*layers)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific regression data: y = x @ TARGET + rank-dependent shift (heterogeneous ranks)."""
    generator = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(size, IN, generator=generator)
    return x, x @ TARGET + 0.1 * rank


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def wrap(comm, module: nn.Module, algorithm=None, **kwargs: Any) -> DecentralizedDataParallel:
    schedule = topologies.one_peer_hypercube(comm.size)
    return DecentralizedDataParallel(module, comm, schedule, algorithm or ExactGossip(), **kwargs)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def weights_flip_on_rank_1(rank: int) -> Schedule:
    """Alternating pairings; from step 40 on rank 1 keeps 0.75 instead of 0.5 (same edges: the exchange completes)."""

    def step(t: int):
        keep = 0.75 if rank == 1 and t >= 40 else 0.5
        pairs = [(0, 1), (2, 3)] if t % 2 == 0 else [(0, 2), (1, 3)]
        rows = [i for a, b in pairs for i in (a, a, b, b)]
        cols = [j for a, b in pairs for j in (a, b, a, b)]
        weights = [w for _ in pairs for w in (keep, 1 - keep, 1 - keep, keep)]
        return np.array(rows), np.array(cols), np.array(weights)

    return Schedule(4, "pairs", step, None, window=32, validate=False)


def train(
    comm,
    steps: int,
    *,
    make_optimizer=None,
    micro_batches: int = 1,
    batch_size: int = 16,
    algorithm=None,
    **wrap_kwargs: Any,
) -> dict[str, Any]:
    """Train for ``steps`` optimizer steps; each step's batch is split into ``micro_batches`` accumulated parts."""
    model = wrap(comm, make_mlp(comm.rank), algorithm, **wrap_kwargs)
    make_optimizer = make_optimizer or (lambda params: torch.optim.SGD(params, lr=0.05))
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(comm.rank, step, batch_size)
        total = 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            loss = loss_of(model, xs, ys) / micro_batches
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        model.log(loss=total)
        losses.append(total)
    result = {"losses": losses, "params": flat_parameters(model), "metrics": model.metrics.last}
    result["summary"] = model.close()
    return result


def accum_adamw(parameters: Any) -> torch.optim.Optimizer:
    """checkpoint_resume's default optimizer: AccumAdamW, lr 1e-2, accum_iter 2."""
    return optim.AccumAdamW(parameters, lr=1e-2, accum_iter=2)


def checkpoint_resume(
    comm,
    directory: str | Path,
    algorithm_factory=ExactGossip,
    dcp: bool = False,
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = accum_adamw,
    **wrap_kwargs: Any,
) -> dict[str, Any]:
    """6 steps uninterrupted vs 3 + save + fresh objects + load + 3 (``optimizer_factory``'s optimizer, by default
    AccumAdamW with accum_iter=2), with an LR scheduler, a private generator that perturbs each batch, and a plain
    dict saved as ``extra`` state; ``dcp``: through a torch.distributed.checkpoint directory per rank (save_dcp /
    load_dcp); ``wrap_kwargs`` go to the wrapper (e.g. ``gradient_tracking=True``)."""
    save, load = (save_dcp, load_dcp) if dcp else (save_checkpoint, load_checkpoint)

    def run(model, optimizer, scheduler, generator, progress, steps: range) -> None:
        for step in steps:
            x, y = batch(comm.rank, step)
            loss_of(model, x + 0.1 * torch.randn(x.shape, generator=generator), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            progress["batches"] = progress.get("batches", 0) + 1

    def fresh(seed: int) -> tuple:
        model = wrap(comm, make_mlp(seed), algorithm_factory(), **wrap_kwargs)
        optimizer = optimizer_factory(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return model, optimizer, scheduler, torch.Generator().manual_seed(seed), {}

    model, optimizer, scheduler, generator, progress = fresh(comm.rank)
    run(model, optimizer, scheduler, generator, progress, range(6))
    uninterrupted = flat_parameters(model)
    model.close()

    model, optimizer, scheduler, generator, progress = fresh(comm.rank)
    run(model, optimizer, scheduler, generator, progress, range(3))
    extra = {"scheduler": scheduler, "generator": generator, "progress": progress}
    save(directory, model, optimizer, extra=extra)
    model.close()

    model, optimizer, scheduler, generator, progress = fresh(100 + comm.rank)
    extra = {"scheduler": scheduler, "generator": generator, "progress": progress}
    resumed_at = load(directory, model, optimizer, extra=extra)
    restored = {"batches": progress.get("batches"), "lr": optimizer.param_groups[0]["lr"]}
    run(model, optimizer, scheduler, generator, progress, range(resumed_at, 6))
    resumed = flat_parameters(model)
    model.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "resumed_at": resumed_at, "restored": restored}


def averaged_and_consensus(comm) -> dict[str, Any]:
    """Two training steps, then: exact consensus distance, and the average inside ``averaged()`` vs after it."""
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(comm.rank, step)
        loss_of(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    before = flat_parameters(model)
    consensus = model.consensus_distance()
    with model.averaged():
        inside = flat_parameters(model)
    after = flat_parameters(model)
    model.close()
    return {"before": before, "inside": inside, "after": after, "consensus": consensus}


def two_wrappers(comm, steps: int = 6) -> dict[str, torch.Tensor]:
    """Two models wrapped by the default pipeline on one communicator and stepped in turn, a critic trained on the
    first model's detached output: the first's loss does not depend on the critic, so its trajectory must be the one
    it has wrapped alone (``alone``, the same steps without the critic), whatever the two wrappers' messages
    interleave."""

    def run(with_critic: bool) -> list[torch.Tensor]:
        first, first_optimizer = gossip.wrap(make_mlp(comm.rank), comm, lr=1e-2)
        critic = critic_optimizer = None
        if with_critic:
            critic_module = nn.Linear(OUT, 1)
            generator = torch.Generator().manual_seed(50 + comm.rank)
            with torch.no_grad():
                for p in critic_module.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
            critic, critic_optimizer = gossip.wrap(critic_module, comm, lr=1e-2)
        for step in range(steps):
            x, y = batch(comm.rank, step)
            output = first(x)
            if critic is not None:
                critic(output.detach()).pow(2).mean().backward()
                critic_optimizer.step()
                critic_optimizer.zero_grad()
            nn.functional.mse_loss(output, y).backward()
            first_optimizer.step()
            first_optimizer.zero_grad()
        trained = [flat_parameters(model) for model in (first, critic) if model is not None]
        for model in (first, critic):
            if model is not None:
                model.close()
        return trained

    (first, critic), (alone,) = run(True), run(False)
    return {"first": first, "critic": critic, "alone": alone}


SKIP_RANK, SKIP_STEP = 1, 2


def skip_one_update(comm, scaler: bool) -> tuple[torch.Tensor, int]:
    """5 SGD steps; rank 1's update of step 2 is skipped: by a GradScaler that finds an overflow (``scaler``), or
    as the reference, by a zero gradient, so that its optimizer step only mixes."""
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(5):
        loss = loss_of(model, *batch(comm.rank, step))
        overflow = comm.rank == SKIP_RANK and step == SKIP_STEP
        if scaler:
            grad_scaler.scale(loss * (float("inf") if overflow else 1.0)).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
        else:
            loss.backward()
            if overflow:
                optimizer.zero_grad(set_to_none=False)
            optimizer.step()
        optimizer.zero_grad()
    model.close()
    return flat_parameters(model), model.step_count


def run_all(comm, directory: Path) -> dict[str, Any]:
    """Every scenario the multiprocess test compares with the simulator."""
    return {
        "train": train(comm, 8),
        "checkpoint": checkpoint_resume(comm, directory / "checkpoint"),
        "averaged": averaged_and_consensus(comm),
        "grad_scaler_skip": skip_one_update(comm, True),
        "two_wrappers": two_wrappers(comm),
        "tracking": train(comm, 8, gradient_tracking=True),
        "tracking_checkpoint": checkpoint_resume(comm, directory / "tracking", gradient_tracking=True),
        "delayed": train(comm, 8, algorithm=delayed_powergossip()),
        "delayed_checkpoint": checkpoint_resume(comm, directory / "delayed", delayed_powergossip),
    }


def delayed_powergossip() -> PowerGossip:
    """PowerGossip whose last power iteration is applied at the next step (an exchange in flight across steps)."""
    return PowerGossip(rank=1, num_iterations=2, delayed_last_iteration=True)


def train_with_an_extra_step_on_rank_1(model: DecentralizedDataParallel, optimizer, rank: int) -> None:
    """Four SGD steps; rank 1 calls optimizer.step() twice in step 1 (a mixing-only step on one rank only)."""
    for step in range(4):
        loss_of(model, *batch(rank, step)).backward()
        optimizer.step()
        if rank == 1 and step == 1:
            optimizer.step()
        optimizer.zero_grad()
