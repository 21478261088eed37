"""``save_checkpoint`` and ``load_checkpoint``: the collective save of every rank's ``rank<r>.pt`` (two-phase
commit, or a background write) and the collective, checked load."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gossip.checkpoint.agreement import agree_on_load, raise_gathered, write_failure
from gossip.checkpoint.async_save import CheckpointFuture, start_async_save, wait_pending
from gossip.checkpoint.file_format import (
    checkpoint_path,
    commit_temporary,
    read_checkpoint,
    remove_temporaries,
    write_temporary,
)
from gossip.checkpoint.state import rank_state, restore
from gossip.errors import UntrustedCheckpointError
from gossip.parallel import DecentralizedDataParallel


def save_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    trusted: bool = False,
) -> Path | CheckpointFuture:
    """Write this rank's checkpoint to ``path_dir/rank<r>.pt``; return its path. A collective (see
    :mod:`gossip.checkpoint`): every rank calls it at the same step.

    ``extra``: more state for the same file (see :mod:`gossip.checkpoint`): objects with ``state_dict()``, a
    ``torch.Generator``, or plain dicts. ``async_save``: snapshot to host memory and write in the background;
    return a :class:`CheckpointFuture`. ``trusted``: allow state that only a pickling (trusted) load restores.

    Raises :class:`~gossip.errors.CheckpointWriteError` on every rank when a rank could not write its file (no
    rank replaced its previous checkpoint), :class:`~gossip.errors.UntrustedCheckpointError` for state that needs
    ``trusted=True``, ``TypeError`` for an ``extra`` value that cannot be restored in place.
    """
    model._require_usable("save_checkpoint()")
    wait_pending(model)
    if model.schedule.period is None:  # a run whose schedules diverged never saves
        model._check_schedule_agreement()
    rank, step = model.comm.rank, model.step_count
    path = checkpoint_path(path_dir, rank)
    remove_temporaries(path)
    problem, state, temporary = None, None, None
    try:
        state = rank_state(model, optimizer, dict(extra or {}), trusted)
    except UntrustedCheckpointError as error:
        problem = ("untrusted", str(error))
    except (TypeError, RuntimeError) as error:
        problem = (type(error).__name__ if type(error) in (TypeError, RuntimeError) else "RuntimeError", str(error))
    if async_save:
        raise_gathered(model.comm.all_gather_object(problem), "")
        return start_async_save(model, path, state, step)
    if problem is None:
        try:
            temporary = write_temporary(state, path)
        except Exception as error:
            problem = ("write", write_failure(rank, path, error, step))
    del state
    problems = model.comm.all_gather_object(problem)
    if any(p is not None for p in problems) and temporary is not None:
        temporary.unlink(missing_ok=True)
    raise_gathered(problems, "no rank replaced its previous checkpoint")
    try:
        commit_temporary(temporary, path)
        problem = None
    except OSError as error:
        temporary.unlink(missing_ok=True)
        problem = ("write", write_failure(rank, path, error, step))
    raise_gathered(
        model.comm.all_gather_object(problem),
        "the other ranks hold the new checkpoint, the files are now of different saves: save again",
    )
    return path


def load_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> int:
    """Restore this rank's state from ``path_dir/rank<r>.pt``; return the step t to resume at. A collective.

    ``extra``: the objects to restore in place, under the keys given to :func:`save_checkpoint` (a dict saved as
    a plain value is cleared and refilled: pass e.g. ``{"progress": {}}`` and read it after the call).
    ``trusted``: unpickle objects other than plain data (runs code named by the file: only for your own files).
    Waits for a pending asynchronous save of ``model`` first, and removes this rank's stale temporary files.
    """
    model._require_usable("load_checkpoint()")  # a closed wrapper or communicator: refused before any collective
    wait_pending(model)
    extra = dict(extra or {})
    rank = model.comm.rank
    path = checkpoint_path(path_dir, rank)
    remove_temporaries(path)
    state, problem = None, None
    if path.exists():
        try:
            state = read_checkpoint(path, trusted=trusted)
        except UntrustedCheckpointError as error:
            problem = ("untrusted", f"rank {rank}: {error}")
        except ValueError as error:
            problem = ("mismatch", f"rank {rank}: {error}")
    agree_on_load(model, path, state, problem, extra)
    return restore(state, model, optimizer, extra)
