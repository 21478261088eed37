"""Asynchronous saves: the state copied to host memory, then written to a temporary file by a background thread
while training goes on; :meth:`CheckpointFuture.wait` commits it with the same two phases as a synchronous save
(every rank's file replaces its previous one only if every rank wrote), so a failed asynchronous save too leaves
every rank's previous checkpoint in place."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from gossip.checkpoint.agreement import commit_on_every_rank, write_failure
from gossip.checkpoint.file_format import commit_temporary, write_temporary
from gossip.wrapper.parallel import DecentralizedDataParallel


def _host_copy(obj: Any, owned: set[int]) -> Any:
    """``obj`` with every tensor copied to host memory (pinned when it lives on a GPU), except the ``owned``
    host tensors, which nothing else refers to."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            copy = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            return copy.copy_(obj.detach(), non_blocking=False)
        return obj if id(obj) in owned else obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((key, _host_copy(value, owned)) for key, value in obj.items())
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return type(obj)(_host_copy(value, owned) for value in obj)
    return obj


class CheckpointFuture:
    """A checkpoint being written in the background by ``save_checkpoint(..., async_save=True)``.

    The background thread only writes and fsyncs a temporary file. :meth:`wait`, a collective, commits it:
    the ranks exchange their outcomes and every rank replaces its previous file only if every rank wrote;
    otherwise every rank removes its temporary file and raises :class:`~gossip.errors.CheckpointWriteError`.
    Until :meth:`wait` (or the model's next save or load, which call it) the previous checkpoint is the one on
    disk. :meth:`done` is local and does not block.

    Args:
        model: the wrapper whose state is saved (its communicator commits the save).
        path: this rank's checkpoint file.
        state: the state to write, already copied to host memory.
        step: the step the state belongs to.
    """

    def __init__(self, model: DecentralizedDataParallel, path: Path, state: dict[str, Any], step: int) -> None:
        self.path, self.step, self._comm = path, step, model.comm
        self._problem: tuple[str, str] | None = None
        self._temporary: Path | None = None
        self._waited = False
        self._thread = threading.Thread(target=self._write, args=(state,), name=f"checkpoint-rank{model.comm.rank}")
        self._thread.daemon = True  # a process that exits without wait() leaves a temporary file, removed next time
        self._thread.start()

    def _write(self, state: dict[str, Any]) -> None:
        try:
            self._temporary = write_temporary(state, self.path)
        except Exception as error:
            self._problem = ("write", write_failure(self._comm.rank, self.path, error, self.step))

    def done(self) -> bool:
        """Whether this rank's write has ended (successfully or not); the file is committed by :meth:`wait`.

        Returns:
            True once the background write has ended.
        """
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Wait for this rank's write, then commit every rank's file or none; a collective.

        A second call returns at once.

        Returns:
            This rank's checkpoint file.

        Raises:
            CheckpointWriteError: on every rank, when any rank's write failed (no rank replaced its previous file).
        """
        self._thread.join()
        if self._waited:
            return self.path
        self._waited = True
        commit_on_every_rank(
            self._comm,
            self.path,
            self.step,
            self._temporary,
            self._problem,
            replace=commit_temporary,
            discard=lambda temporary: temporary.unlink(missing_ok=True),
        )
        return self.path


_PENDING: weakref.WeakKeyDictionary[DecentralizedDataParallel, CheckpointFuture] = weakref.WeakKeyDictionary()


def start_async_save(
    model: DecentralizedDataParallel, path: Path, state: dict[str, Any], step: int
) -> CheckpointFuture:
    """Snapshot ``state`` to host memory and write it to ``path`` in the background.

    ``model``'s next save or load waits for it.

    Args:
        model: the wrapper whose state is saved.
        path: this rank's checkpoint file.
        state: the state (:func:`gossip.checkpoint.state.rank_state`); its buckets are already copies.
        step: the step the state belongs to.

    Returns:
        The future to ``wait()`` on.
    """
    owned = {id(t) for t in state["training"]["buckets"]}
    future = CheckpointFuture(model, path, _host_copy(state, owned), step)
    _PENDING[model] = future
    return future


def wait_pending(model: DecentralizedDataParallel) -> None:
    """Wait for ``model``'s pending asynchronous save, if any: a collective, so its error is raised on every rank.

    Args:
        model: the wrapper whose save may be pending.

    Raises:
        CheckpointWriteError: the pending save failed on some rank.
    """
    pending = _PENDING.pop(model, None)
    if pending is not None:
        pending.wait()
