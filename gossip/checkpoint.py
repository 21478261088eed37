"""Checkpoint and resume of a decentralized run: one file per rank, written atomically.

``save_checkpoint(dir, model, optimizer)`` writes ``dir/rank<r>.pt`` holding everything rank r's future depends
on: its parameters x_t (the flat buckets), its buffers, the optimizer's ``state_dict``, the algorithm's state
(PowerGossip's per-edge factors and parity counters), the step counter t (the schedule position) and the RNG
streams (torch, numpy, python ``random``). The file is written to a temporary file in the same directory,
fsynced, then ``os.replace``-d over the old one, so a crash leaves either the old or the new checkpoint.

When to save: after ``optimizer.step()`` (anywhere before the next step's update). The exchange of x_t that the
wrapper started after the update is *not* saved: the algorithm state saved is the one from before that exchange
was started, and a resumed run starts step t's exchange anew at its first forward. The uninterrupted run and
the resumed one therefore compute bit-identical parameters (tests/test_parallel_checkpoint.py).

``load_checkpoint`` is a collective: every rank reads its own file and checks that it belongs to this run --
world size, schedule fingerprint, parameter signature, algorithm name and config -- and if any rank finds a
difference (or no file) every rank raises :class:`CheckpointMismatchError` naming it. Checkpoints are pickles:
load only your own.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gossip.parallel import DecentralizedDataParallel
from gossip.replicas import first_difference

FORMAT_VERSION = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint does not belong to this run (or is missing); the message says what differs on which rank."""


def checkpoint_path(path_dir: str | Path, rank: int) -> Path:
    return Path(path_dir) / f"rank{rank}.pt"


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync it, rename it over ``path``, fsync the dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_checkpoint(path_dir: str | Path, model: DecentralizedDataParallel, optimizer: torch.optim.Optimizer) -> Path:
    """Write this rank's checkpoint to ``path_dir/rank<r>.pt`` (atomically); return its path. Not a collective."""
    state = {
        "format": FORMAT_VERSION,
        "rank": model.comm.rank,
        "signature": model.signature,
        "training": model.training_state(),
        "buffers": {name: b.detach().clone() for name, b in model.module.named_buffers()},
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(),
    }
    path = checkpoint_path(path_dir, model.comm.rank)
    atomic_save(state, path)
    return path


def _problem(path: Path, state: dict[str, Any] | None, model: DecentralizedDataParallel) -> str | None:
    rank = model.comm.rank
    if state is None:
        return f"rank {rank}: no checkpoint file {path}"
    if state.get("format") != FORMAT_VERSION:
        return f"rank {rank}: {path} has format {state.get('format')!r}, this version reads {FORMAT_VERSION}"
    if state["rank"] != rank:
        return f"rank {rank}: {path} was written by rank {state['rank']}"
    difference = first_difference(model.signature, state["signature"], "this run", "the checkpoint")
    return None if difference is None else f"rank {rank}: {path}: {difference}"


def load_checkpoint(path_dir: str | Path, model: DecentralizedDataParallel, optimizer: torch.optim.Optimizer) -> int:
    """Restore this rank's state from ``path_dir/rank<r>.pt``; return the step t to resume at. A collective."""
    path = checkpoint_path(path_dir, model.comm.rank)
    state = torch.load(path, weights_only=False) if path.exists() else None
    problems = [p for p in model.comm.all_gather_object(_problem(path, state, model)) if p is not None]
    if problems:
        raise CheckpointMismatchError(
            problems[0] + (f" (and {len(problems) - 1} more rank(s))" if problems[1:] else "")
        )
    model.load_training_state(state["training"])
    buffers = dict(model.module.named_buffers())
    with torch.no_grad():
        for name, saved in state["buffers"].items():
            buffers[name].copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    return model.step_count
