"""The state one rank saves and restores: its parameters, buffers, optimizer, algorithm state and step counter,
its RNG streams, the user's ``extra`` entries; the checks that a saved state belongs to this run."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gossip.checkpoint.safe_loading import first_unsafe_item
from gossip.errors import ArgumentTypeError, UntrustedCheckpointError
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.replicas import first_difference

#: The wrapper settings a checkpoint must share with the run that loads it (the bucket layout).
CHECKPOINT_SETTINGS = ("bucket_bytes",)


# -- RNG state as plain data (loadable with weights_only=True) ----------------------------------------------------
def _rng_state() -> dict[str, Any]:
    kind, keys, position, has_gauss, cached = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))
    return {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # format 2 stored the numpy array itself
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# -- the state ----------------------------------------------------------------------------------------------------
def _extra_entry(key: str, value: Any, rank: int) -> dict[str, Any]:
    if isinstance(value, torch.Generator):
        return {"kind": "generator", "state": value.get_state()}
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return {"kind": "state_dict", "state": value.state_dict()}
    if isinstance(value, dict):
        return {"kind": "dict", "state": dict(value)}
    raise ArgumentTypeError(
        f"rank {rank}: save_checkpoint: extra[{key!r}] (type {type(value).__name__}) cannot be restored in place: "
        "extra values must have state_dict()/load_state_dict(), be a torch.Generator, or be a dict (wrap a plain "
        f"value in one: extra={{{key!r}: {{{key!r}: value}}}})"
    )


def _extra_kind(value: Any) -> str:
    if isinstance(value, torch.Generator):
        return "generator"
    if callable(getattr(value, "load_state_dict", None)):
        return "state_dict"
    return "dict" if isinstance(value, dict) else type(value).__name__


def rank_state(
    model: DecentralizedDataParallel, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any], trusted: bool
) -> dict[str, Any]:
    """This rank's state; tensors other than the buckets (copied by ``training_state``) are the live ones.

    Args:
        model: the wrapper to save.
        optimizer: its optimizer.
        extra: the user's extra state (objects with ``state_dict()``, generators, dicts).
        trusted: allow objects that only a pickling load restores.

    Returns:
        The state: rank, signature, training state, buffers, frozen parameters, optimizer, RNG streams, extra.

    Raises:
        ArgumentTypeError: an ``extra`` value cannot be restored in place.
        UntrustedCheckpointError: the state holds objects a weights-only load refuses and ``trusted`` is False.
        StepPhaseError: called between the mixing and the optimizer's update.
    """
    rank = model.comm.rank
    state = {
        "rank": rank,
        "signature": model.signature,
        "training": model.training_state(),
        "buffers": {name: b.detach() for name, b in model.module.named_buffers()},
        "frozen": {name: p.detach() for name, p in model.module.named_parameters() if not p.requires_grad},
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(),
        "extra": {key: _extra_entry(key, value, rank) for key, value in extra.items()},
    }
    unsafe = None if trusted else first_unsafe_item(state, "state")
    if unsafe is not None:
        where, kind = unsafe
        raise UntrustedCheckpointError(
            f"rank {rank}: save_checkpoint: {where.replace('state', 'the checkpoint', 1)} is a {kind}, which a "
            "weights-only load refuses (it would run pickled code): make it plain data (tensors, numbers, strings, "
            "lists, dicts), or pass trusted=True to save_checkpoint and to load_checkpoint (load such a file only "
            "if you wrote it yourself)"
        )
    return state


def mismatch(
    path: Path, state: dict[str, Any] | None, model: DecentralizedDataParallel, extra: Mapping[str, Any]
) -> str | None:
    """Why the saved ``state`` does not belong to this run (or is missing), or None when it does.

    Args:
        path: the file it was read from.
        state: the saved state, or None when there is no file.
        model: the wrapper to restore.
        extra: the ``extra`` objects passed to the load.

    Returns:
        A sentence naming the rank and the difference, or None.
    """
    rank = model.comm.rank
    if state is None:
        return f"rank {rank}: no checkpoint file {path}"
    if state["rank"] != rank:
        return f"rank {rank}: {path} was written by rank {state['rank']}"
    difference = first_difference(
        model.signature, state["signature"], "this run", "the checkpoint", settings=CHECKPOINT_SETTINGS
    )
    if difference is not None:
        return f"rank {rank}: {path}: {difference}"
    saved = state["extra"]
    missing, unexpected = sorted(set(saved) - set(extra)), sorted(set(extra) - set(saved))
    if missing or unexpected:
        return (
            f"rank {rank}: {path}: the extra state saved has keys {sorted(saved)} but load_checkpoint was given "
            f"{sorted(extra)} (missing {missing}, unexpected {unexpected}); pass the same keys as to save_checkpoint"
        )
    for key, entry in saved.items():
        if _extra_kind(extra[key]) != entry["kind"]:
            return (
                f"rank {rank}: {path}: extra[{key!r}] was saved as a {entry['kind']} but load_checkpoint was given "
                f"a {type(extra[key]).__name__}"
            )
    return None


def _restore_extra(saved: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, entry in saved.items():
        target = extra[key]
        if entry["kind"] == "generator":
            target.set_state(entry["state"])
        elif entry["kind"] == "state_dict":
            target.load_state_dict(entry["state"])
        else:
            target.clear()
            target.update(entry["state"])


def restore(
    state: dict[str, Any],
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any],
) -> int:
    """Restore ``state`` into the wrapper, the optimizer, the RNG streams and ``extra`` (in place).

    Args:
        state: a state :func:`mismatch` accepted.
        model: the wrapper.
        optimizer: its optimizer.
        extra: the objects to restore in place.

    Returns:
        The step to resume at.
    """
    model.load_training_state(state["training"])
    tensors = {**dict(model.module.named_buffers()), **dict(model.module.named_parameters())}
    with torch.no_grad():
        for name, saved in [*state["buffers"].items(), *state["frozen"].items()]:
            tensors[name].copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    _restore_extra(state["extra"], extra)
    return model.step_count
