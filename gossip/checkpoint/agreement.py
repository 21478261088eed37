"""How the ranks reach one outcome: each rank's problem (a failed write, a file that does not belong to this
run) is gathered, and every rank raises the same named error."""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gossip.backends.base import Communicator
from gossip.checkpoint.state import mismatch, rank_state
from gossip.errors import (
    ArgumentTypeError,
    CheckpointMismatchError,
    CheckpointWriteError,
    StepPhaseError,
    UntrustedCheckpointError,
)
from gossip.wrapper.parallel import DecentralizedDataParallel


def write_failure(rank: int, path: Path, error: BaseException, step: int) -> str:
    """One sentence: which rank failed to write which file at which step, why, and what to do.

    Args:
        rank: the rank that failed.
        path: its checkpoint file.
        error: the error of the write.
        step: the step being saved.

    Returns:
        The sentence, the message of the :class:`~gossip.errors.CheckpointWriteError` every rank raises.
    """
    code = getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        advice = f"the file system of {path.parent} is full (or over quota): free space there or save elsewhere"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = f"this process may not write in {path.parent}: fix its permissions or save elsewhere"
    else:
        advice = f"check the file system of {path.parent}, or save elsewhere"
    previous = "its previous checkpoint is unchanged" if path.exists() else "it had no previous checkpoint"
    return (
        f"rank {rank}: save_checkpoint at step {step} could not write {path} ({type(error).__name__}: {error}); "
        f"{advice}; {previous}"
    )


def raise_gathered(problems: list[Any], what: str) -> None:
    """Raise the first rank's problem on this rank (every rank raises the same), if any rank had one.

    Args:
        problems: every rank's ``(kind, message)`` or None, as gathered.
        what: appended to a failed write's message: what the ranks' files now hold.

    Raises:
        UntrustedCheckpointError: the state needs ``trusted=True``.
        ArgumentTypeError: an ``extra`` value cannot be restored in place.
        StepPhaseError: the save was called between the mixing and the optimizer's update.
        CheckpointWriteError: a rank could not write its file (or capture its state).
    """
    found = [p for p in problems if p is not None]
    if not found:
        return
    kind, message = found[0]
    more = f" (and {len(found) - 1} more rank(s))" if found[1:] else ""
    text = message + more + (f"; {what}" if kind == "write" else "")
    if kind == "untrusted":
        raise UntrustedCheckpointError(text)
    if kind == "TypeError":
        raise ArgumentTypeError(text)
    if kind == "phase":
        raise StepPhaseError(text)
    raise CheckpointWriteError(text)  # a failed write, or another RuntimeError while capturing the state


def agree_on_load(
    model: DecentralizedDataParallel,
    path: Path,
    state: dict[str, Any] | None,
    problem: tuple[str, str] | None,
    extra: Mapping[str, Any],
) -> None:
    """The collective check of ``load_checkpoint`` and ``load_dcp``.

    Every rank raises the first rank's problem, if any, and the ranks' files must hold the same step.

    Args:
        model: the wrapper to restore.
        path: this rank's checkpoint.
        state: the state read from it, or None when there is none.
        problem: this rank's ``(kind, message)`` from reading it, or None.
        extra: the ``extra`` objects to restore (their keys and kinds must match the saved ones).

    Raises:
        UntrustedCheckpointError: a rank's file needs ``trusted=True``.
        CheckpointMismatchError: a rank's file is missing, corrupt or of another run, or the files hold different
            steps.
    """
    if problem is None:
        message = mismatch(path, state, model, extra)
        problem = None if message is None else ("mismatch", message)
    step = None if state is None else int(state["training"]["step"])
    gathered = model.comm.all_gather_object((problem, step, str(path)))
    problems = [p for p, _, _ in gathered if p is not None]
    if problems:
        kind, message = problems[0]
        text = message + (f" (and {len(problems) - 1} more rank(s))" if problems[1:] else "")
        if kind == "untrusted":
            raise UntrustedCheckpointError(text)
        raise CheckpointMismatchError(text)
    steps = [s for _, s, _ in gathered]
    if len(set(steps)) > 1:
        other = next(r for r, s in enumerate(steps) if s != steps[0])
        raise CheckpointMismatchError(
            f"rank {other}: {gathered[other][2]} holds step {steps[other]} but rank 0's {gathered[0][2]} holds step "
            f"{steps[0]}: the files come from different saves; restore one save's files on every rank"
        )


def capture_state(
    model: DecentralizedDataParallel, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any] | None, trusted: bool
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """This rank's state, or the problem every rank will raise (:func:`raise_gathered`) instead of saving.

    Args:
        model: the wrapper to save.
        optimizer: its optimizer.
        extra: the user's extra state.
        trusted: allow state that only a pickling load restores.

    Returns:
        ``(state, None)``, or ``(None, (kind, message))`` when the state cannot be saved.
    """
    try:
        return rank_state(model, optimizer, dict(extra or {}), trusted), None
    except UntrustedCheckpointError as error:
        return None, ("untrusted", str(error))
    except (TypeError, RuntimeError) as error:
        kind = "phase" if isinstance(error, StepPhaseError) else "TypeError" if isinstance(error, TypeError) else ""
        return None, (kind or "RuntimeError", str(error))


def commit_on_every_rank(
    comm: Communicator,
    path: Path,
    step: int,
    temporary: Path | None,
    problem: tuple[str, str] | None,
    *,
    replace: Callable[[Path, Path], None],
    discard: Callable[[Path], None],
) -> None:
    """The two phases of the save of ``step``, after each rank wrote ``temporary`` (or met ``problem``).

    The ranks exchange their outcomes; if any failed, every rank discards its temporary and raises the same
    error (no previous checkpoint replaced); otherwise every rank ``replace``-s its previous checkpoint at
    ``path`` and the ranks exchange that outcome too.

    Args:
        comm: the communicator of the ranks.
        path: this rank's checkpoint.
        step: the step being saved.
        temporary: the file this rank wrote, or None when it met a problem.
        problem: this rank's ``(kind, message)``, or None.
        replace: moves the temporary over ``path``.
        discard: removes the temporary.

    Raises:
        CheckpointWriteError: a rank could not write (or replace) its file.
    """
    rank = comm.rank
    problems = comm.all_gather_object(problem)
    if any(p is not None for p in problems) and temporary is not None:
        discard(temporary)
    raise_gathered(problems, "no rank replaced its previous checkpoint")
    assert temporary is not None, "no problem on any rank, so this rank wrote its temporary file"
    problem = None
    try:
        replace(temporary, path)
    except OSError as error:
        discard(temporary)
        problem = ("write", write_failure(rank, path, error, step))
    raise_gathered(
        comm.all_gather_object(problem),
        "the other ranks hold the new checkpoint, the files are now of different saves: save again",
    )
