"""The same per-rank state as a ``torch.distributed.checkpoint`` (DCP) directory per rank: ``save_dcp``,
``read_dcp``, ``load_dcp``, with the collective commit, checks and errors of the ``rank<r>.pt`` files."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gossip.checkpoint.agreement import capture_state, commit_on_every_rank, write_failure
from gossip.checkpoint.async_save import wait_pending
from gossip.checkpoint.safe_loading import SAFE_GLOBALS, weights_only_refusal
from gossip.checkpoint.save_load import begin_save, load_on_every_rank
from gossip.errors import CheckpointMismatchError, UntrustedCheckpointError
from gossip.wrapper.parallel import DecentralizedDataParallel

_TENSOR = "__gossip_dcp_tensor__"
_STRUCTURE = "gossip.structure"


def dcp_path(path_dir: str | Path, rank: int) -> Path:
    """Rank ``rank``'s DCP checkpoint directory in ``path_dir``.

    Args:
        path_dir: the checkpoint directory.
        rank: the rank.

    Returns:
        ``path_dir/rank<r>.dcp``.
    """
    return Path(path_dir) / f"rank{rank}.dcp"


def _split(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``{_TENSOR: key}`` and put in ``tensors`` under its dotted key."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        return type(obj)((k, _split(v, f"{key}.{k}" if key else str(k), tensors)) for k, v in obj.items())
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return type(obj)(_split(v, f"{key}.{i}" if key else str(i), tensors) for i, v in enumerate(obj))
    return obj


def _join(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        return type(obj)((k, _join(v, tensors)) for k, v in obj.items())
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _dcp_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The DCP state dict: every tensor under its dotted path (``optimizer.state.0.exp_avg``,
    ``training.buckets.0``), and the rest of the structure as a uint8 tensor holding a ``torch.save`` of plain
    data (DCP itself unpickles non-tensor items with ``weights_only=False``; this keeps the load weights-only)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _split(state, "", tensors)
    buffer = io.BytesIO()
    torch.save(structure, buffer)
    return {**tensors, _STRUCTURE: torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}


def _replace_directory(temporary: Path, path: Path) -> None:
    """Put the directory ``temporary`` at ``path``: the previous one is moved aside first and removed only once the
    new one is in place (moved back if the rename fails)."""
    aside = path.parent / f".{path.name}.{temporary.name}.old"
    moved = path.exists()
    if moved:
        os.replace(path, aside)
    try:
        os.replace(temporary, path)
    except OSError:
        if moved:
            os.replace(aside, path)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def save_dcp(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> Path:
    """Write this rank's checkpoint as a ``torch.distributed.checkpoint`` directory ``path_dir/rank<r>.dcp``.

    Each rank's replica is its own state: one DCP checkpoint per rank, saved with ``no_dist=True``. A
    collective with the same two-phase commit and errors as :func:`save_checkpoint`: the directory is written as
    ``.rank<r>.dcp.<random>.tmp`` and renamed in place (the previous one moved aside, then removed) only if
    every rank wrote its own.

    Any DCP reader opens it without a process group, e.g. ``dcp.load({"optimizer.state.0.exp_avg": t},
    checkpoint_id=dir / "rank0.dcp", no_dist=True)``; the tensors are stored under their dotted paths in the
    state (``training.buckets.<i>`` are the flat parameter buckets x_t, ``optimizer.state.<i>.<name>``,
    ``buffers.<name>``, ``frozen.<name>``, ``extra.<key>.state...``), the rest of the state as the uint8 tensor
    ``gossip.structure``. :func:`load_dcp` restores it with the checks of :func:`load_checkpoint`.

    Args:
        path_dir: the checkpoint directory.
        model: the wrapper to save.
        optimizer: its optimizer.
        extra: more state for the same checkpoint (as for :func:`save_checkpoint`).
        trusted: allow state that only a pickling (trusted) load restores.

    Returns:
        This rank's directory.

    Raises:
        CheckpointWriteError: on every rank, when a rank could not write its directory.
        UntrustedCheckpointError: the state needs ``trusted=True``.
        ArgumentTypeError: an ``extra`` value cannot be restored in place.
    """
    import torch.distributed.checkpoint as dcp

    begin_save(model, "save_dcp()")
    rank, step = model.comm.rank, model.step_count
    path = dcp_path(path_dir, rank)
    for stale in path.parent.glob(f".{path.name}.*.tmp") if path.parent.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)
    captured, problem = capture_state(model, optimizer, extra, trusted)
    temporary = None
    if problem is None:
        state = _dcp_state(captured)
        del captured
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            dcp.save(state, checkpoint_id=temporary, no_dist=True)
        except Exception as error:
            shutil.rmtree(temporary, ignore_errors=True)
            temporary, cause = None, error
            while cause.__cause__ is not None and not isinstance(cause, OSError):
                cause = cause.__cause__
            problem = ("write", write_failure(rank, path, cause, step))
        del state
    commit_on_every_rank(
        model.comm,
        path,
        step,
        temporary,
        problem,
        replace=_replace_directory,
        discard=lambda directory: shutil.rmtree(directory, ignore_errors=True),
    )
    return path


def read_dcp(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """The state saved by :func:`save_dcp` in one rank's DCP directory (read without a process group).

    Args:
        path: the rank's ``.dcp`` directory.
        trusted: unpickle objects other than plain data (only for your own files).

    Returns:
        The state, as :func:`gossip.checkpoint.state.rank_state` built it.

    Raises:
        CheckpointMismatchError: the directory is unreadable, truncated or not a gossip-train DCP checkpoint.
        UntrustedCheckpointError: it holds objects a weights-only load refuses and ``trusted`` is False.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        template = {
            key: torch.empty(item.size, dtype=item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }
        dcp.load(template, checkpoint_id=path, no_dist=True)
        structure = template.pop(_STRUCTURE).numpy().tobytes()
    except Exception as error:
        raise CheckpointMismatchError(
            f"{path} is unreadable, truncated or not a gossip-train DCP checkpoint ({type(error).__name__}: {error})"
        ) from error
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            state = torch.load(io.BytesIO(structure), weights_only=not trusted)
    except pickle.UnpicklingError as error:
        raise UntrustedCheckpointError(
            f"{path} holds objects that a weights-only load refuses ({weights_only_refusal(error)}): loading it "
            "would run pickled code; pass trusted=True to load_dcp only if you wrote this checkpoint yourself"
        ) from error
    return _join(state, template)


def load_dcp(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> int:
    """Restore this rank's state from the DCP directory ``path_dir/rank<r>.dcp`` written by :func:`save_dcp`.

    A collective, with the checks and errors of :func:`load_checkpoint`.

    Args:
        path_dir: the checkpoint directory.
        model: the wrapper to restore.
        optimizer: its optimizer.
        extra: the objects to restore in place, under the keys given to :func:`save_dcp`.
        trusted: unpickle objects other than plain data (only for your own files).

    Returns:
        The step to resume at.

    Raises:
        CheckpointMismatchError: a rank's checkpoint is missing, corrupt, of another run or of another save.
        UntrustedCheckpointError: a rank's checkpoint needs ``trusted=True``.
    """
    model._require_usable("load_dcp()")
    wait_pending(model)
    return load_on_every_rank(dcp_path(path_dir, model.comm.rank), read_dcp, model, optimizer, extra, trusted)
