"""Checkpoint and resume of a decentralized run: one file per rank, written atomically, with a checksum.

``save_checkpoint(dir, model, optimizer, extra=...)`` writes ``dir/rank<r>.pt`` holding everything rank r's
future depends on: its parameters x_t (the flat buckets), its frozen parameters and buffers, the optimizer's
``state_dict``, the algorithm's state (PowerGossip's per-edge factors and parity counters), the step counter t
(the schedule position), the RNG streams (torch, numpy, python ``random``) and the user's ``extra`` state
(below). The file is written to a temporary file in the same directory, fsynced, then ``os.replace``-d over
the old one, so a crash leaves either the old or the new checkpoint. The state is stored with the SHA-256 of its
serialised bytes, so a truncated or corrupted file is named at load time instead of failing later inside an
exchange.

Extra state (``extra={"scheduler": scheduler, "scaler": scaler, "generator": g, "progress": {...}}``), in the
same per-rank file:

* an object with ``state_dict()`` / ``load_state_dict()`` (an LR scheduler, a ``GradScaler``, a sampler, ...) is
  saved through ``state_dict()`` and restored in place through ``load_state_dict()``;
* a ``torch.Generator`` is saved through ``get_state()`` and restored in place through ``set_state()``;
* a plain ``dict`` (e.g. ``{"epoch": 3, "batch": 120}``) is saved as is; at load, pass a dict under the same key
  (usually an empty one, ``extra={"progress": {}}``): it is cleared and filled in place with the saved items.
  Anything else is refused at save time (wrap it in a dict).

``load_checkpoint`` takes the same keys: a key saved but not passed, or passed but not saved, is an error.

When to save: after ``optimizer.step()`` (anywhere before the next step's update). The exchange of x_t that the
wrapper started after the update is *not* saved: the algorithm state saved is the one from before that exchange
was started, and a resumed run starts step t's exchange anew at its first forward. The uninterrupted run and
the resumed one therefore compute bit-identical parameters (tests/test_parallel_checkpoint.py).

``load_checkpoint`` is a collective: every rank reads its own file, verifies its checksum and checks that it
belongs to this run -- world size, schedule fingerprint, parameter signature, ``bucket_bytes``, algorithm name and
config, the ``extra`` keys -- and that every rank's file holds the same step (files of different saves mixed
up); if any rank finds a problem (or no file) every rank raises :class:`CheckpointMismatchError` naming the rank
and the file. Checkpoints are pickles: load only your own.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gossip.parallel import DecentralizedDataParallel
from gossip.replicas import first_difference

FORMAT_VERSION = 2
#: The wrapper settings a checkpoint must share with the run that loads it (the bucket layout).
CHECKPOINT_SETTINGS = ("bucket_bytes",)


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


def _extra_entry(key: str, value: Any, rank: int) -> dict[str, Any]:
    if isinstance(value, torch.Generator):
        return {"kind": "generator", "state": value.get_state()}
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return {"kind": "state_dict", "state": value.state_dict()}
    if isinstance(value, dict):
        return {"kind": "dict", "state": dict(value)}
    raise TypeError(
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


def save_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write this rank's checkpoint to ``path_dir/rank<r>.pt`` (atomically); return its path. Not a collective.

    ``extra``: more state for the same file (see the module docstring): objects with ``state_dict()``, a
    ``torch.Generator``, or plain dicts.
    """
    rank = model.comm.rank
    state = {
        "rank": rank,
        "signature": model.signature,
        "training": model.training_state(),
        "buffers": {name: b.detach().clone() for name, b in model.module.named_buffers()},
        "frozen": {name: p.detach().clone() for name, p in model.module.named_parameters() if not p.requires_grad},
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(),
        "extra": {key: _extra_entry(key, value, rank) for key, value in (extra or {}).items()},
    }
    payload = io.BytesIO()
    torch.save(state, payload)
    data = payload.getvalue()
    path = checkpoint_path(path_dir, rank)
    atomic_save({"format": FORMAT_VERSION, "sha256": hashlib.sha256(data).hexdigest(), "state": data}, path)
    return path


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state saved in one rank's file, after verifying the file's checksum; ``ValueError`` says what is wrong."""
    try:
        envelope = torch.load(path, weights_only=False)
    except Exception as error:  # a truncated zip, a pickle error, ...: the file is unreadable, whatever the cause
        raise ValueError(
            f"{path} is unreadable, truncated or not a checkpoint ({type(error).__name__}: {error})"
        ) from error
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT_VERSION:
        found = envelope.get("format") if isinstance(envelope, dict) else type(envelope).__name__
        raise ValueError(f"{path} has format {found!r}, this version reads {FORMAT_VERSION}")
    if hashlib.sha256(envelope["state"]).hexdigest() != envelope["sha256"]:
        raise ValueError(f"{path} fails its SHA-256 checksum: the file is corrupt; restore it from a good copy")
    return torch.load(io.BytesIO(envelope["state"]), weights_only=False)


def _problem(
    path: Path, state: dict[str, Any] | None, model: DecentralizedDataParallel, extra: Mapping[str, Any]
) -> str | None:
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


def load_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
) -> int:
    """Restore this rank's state from ``path_dir/rank<r>.pt``; return the step t to resume at. A collective.

    ``extra``: the objects to restore in place, under the keys given to :func:`save_checkpoint` (a dict saved as
    a plain value is cleared and refilled: pass e.g. ``{"progress": {}}`` and read it after the call).
    """
    model._require_usable("load_checkpoint()")  # a closed wrapper or communicator: refused before any collective
    extra = dict(extra or {})
    rank = model.comm.rank
    path = checkpoint_path(path_dir, rank)
    state, problem = None, None
    if path.exists():
        try:
            state = read_checkpoint(path)
        except ValueError as error:
            problem = f"rank {rank}: {error}"
    problem = problem or _problem(path, state, model, extra)
    step = None if state is None else int(state["training"]["step"])
    gathered = model.comm.all_gather_object((problem, step, str(path)))
    problems = [p for p, _, _ in gathered if p is not None]
    if problems:
        raise CheckpointMismatchError(
            problems[0] + (f" (and {len(problems) - 1} more rank(s))" if problems[1:] else "")
        )
    steps = [s for _, s, _ in gathered]
    if len(set(steps)) > 1:
        other = next(r for r, s in enumerate(steps) if s != steps[0])
        raise CheckpointMismatchError(
            f"rank {other}: {gathered[other][2]} holds step {steps[other]} but rank 0's {gathered[0][2]} holds step "
            f"{steps[0]}: the files come from different saves; restore one save's files on every rank"
        )
    model.load_training_state(state["training"])
    tensors = {**dict(model.module.named_buffers()), **dict(model.module.named_parameters())}
    with torch.no_grad():
        for name, saved in [*state["buffers"].items(), *state["frozen"].items()]:
            tensors[name].copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    _restore_extra(state["extra"], extra)
    return model.step_count
