"""``save_checkpoint`` and ``load_checkpoint``: the collective save of every rank's ``rank<r>.pt`` (two-phase
commit, or a background write) and the collective, checked load."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gossip.checkpoint.agreement import (
    agree_on_load,
    capture_state,
    commit_on_every_rank,
    raise_gathered,
    write_failure,
)
from gossip.checkpoint.async_save import CheckpointFuture, start_async_save, wait_pending
from gossip.checkpoint.file_format import (
    checkpoint_path,
    commit_temporary,
    read_checkpoint,
    remove_temporaries,
    write_temporary,
)
from gossip.checkpoint.state import restore
from gossip.errors import UntrustedCheckpointError
from gossip.wrapper.parallel import DecentralizedDataParallel


def begin_save(model: DecentralizedDataParallel, operation: str) -> None:
    """What every save does first, on every rank.

    Refuse a closed wrapper and wait for (and commit) a pending asynchronous save. (Diverged schedules never reach a
    save: every step compares W(t) with its peers, :mod:`gossip.wrapper.peer_agreement`.)

    Args:
        model: the wrapper to save.
        operation: the caller, for the messages (e.g. ``"save_checkpoint()"``).
    """
    model._require_usable(operation)
    wait_pending(model)
    model._settle_exchange()  # the save's collectives may follow a backward that progressed the exchange


def _unlink(temporary: Path) -> None:
    temporary.unlink(missing_ok=True)


def save_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    trusted: bool = False,
) -> Path | CheckpointFuture:
    """Write this rank's checkpoint to ``path_dir/rank<r>.pt``.

    A collective (see :mod:`gossip.checkpoint`): every rank calls it at the same step.

    Args:
        path_dir: the checkpoint directory.
        model: the wrapper to save.
        optimizer: its optimizer.
        extra: more state for the same file (see :mod:`gossip.checkpoint`): objects with ``state_dict()``, a
            ``torch.Generator``, or plain dicts.
        async_save: snapshot to host memory and write in the background.
        trusted: allow state that only a pickling (trusted) load restores.

    Returns:
        This rank's file, or with ``async_save`` a :class:`CheckpointFuture` to ``wait()`` on.

    Raises:
        CheckpointWriteError: on every rank, when a rank could not write its file (no rank replaced its previous
            checkpoint).
        UntrustedCheckpointError: the state needs ``trusted=True``.
        ArgumentTypeError: an ``extra`` value cannot be restored in place.
        UseAfterCloseError: the wrapper was closed.
    """
    begin_save(model, "save_checkpoint()")
    rank, step = model.comm.rank, model.step_count
    path = checkpoint_path(path_dir, rank)
    remove_temporaries(path)
    state, problem = capture_state(model, optimizer, extra, trusted)
    if async_save:
        raise_gathered(model.comm.all_gather_object(problem), "")
        return start_async_save(model, path, state, step)
    temporary = None
    if problem is None:
        try:
            temporary = write_temporary(state, path)
        except Exception as error:
            problem = ("write", write_failure(rank, path, error, step))
    del state
    commit_on_every_rank(model.comm, path, step, temporary, problem, replace=commit_temporary, discard=_unlink)
    return path


def load_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> int:
    """Restore this rank's state from ``path_dir/rank<r>.pt``. A collective.

    Waits for a pending asynchronous save of ``model`` first, and removes this rank's stale temporary files.

    Args:
        path_dir: the checkpoint directory.
        model: the wrapper to restore.
        optimizer: its optimizer.
        extra: the objects to restore in place, under the keys given to :func:`save_checkpoint` (a dict saved as
            a plain value is cleared and refilled: pass e.g. ``{"progress": {}}`` and read it after the call).
        trusted: unpickle objects other than plain data (runs code named by the file: only for your own files).

    Returns:
        The step t to resume at.

    Raises:
        CheckpointMismatchError: a rank's file is missing, corrupt, of another run or of another save.
        UntrustedCheckpointError: a rank's file needs ``trusted=True``.
        UseAfterCloseError: the wrapper was closed.
    """
    model._require_usable("load_checkpoint()")  # a closed wrapper or communicator: refused before any collective
    wait_pending(model)
    path = checkpoint_path(path_dir, model.comm.rank)
    remove_temporaries(path)
    return load_on_every_rank(path, read_checkpoint, model, optimizer, extra, trusted)


def load_on_every_rank(
    path: Path,
    read: Callable[..., dict[str, Any]],
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any] | None,
    trusted: bool,
) -> int:
    """Read this rank's ``path``, check it on every rank and restore it.

    The ranks agree that every file belongs to this run and to one save (:func:`agree_on_load`).

    Args:
        path: this rank's checkpoint.
        read: reads it, called as ``read(path, trusted=...)``.
        model: the wrapper to restore.
        optimizer: its optimizer.
        extra: the objects to restore in place.
        trusted: passed to ``read``.

    Returns:
        The step to resume at.

    Raises:
        CheckpointMismatchError: a rank's file is missing, corrupt, of another run or of another save.
        UntrustedCheckpointError: a rank's file needs ``trusted=True``.
    """
    extra = dict(extra or {})
    model._settle_exchange()  # before the agreement's collective (inside a step, after its backward)
    rank = model.comm.rank
    state, problem = None, None
    if path.exists():
        try:
            state = read(path, trusted=trusted)
        except UntrustedCheckpointError as error:
            problem = ("untrusted", f"rank {rank}: {error}")
        except ValueError as error:
            problem = ("mismatch", f"rank {rank}: {error}")
    agree_on_load(model, path, state, problem, extra)
    return restore(state, model, optimizer, extra)
