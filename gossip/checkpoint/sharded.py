"""Checkpoints of sharded replicas: one ``torch.distributed.checkpoint`` (DCP) directory per replica.

A run of R replicas × G shards (:class:`gossip.ShardedDecentralizedDataParallel`) saves ``path_dir/replica<r>.dcp``
for each replica r, written by the G ranks of that replica together (``dcp.save`` over the replica's FSDP2
process group, the mesh's ``"shard"`` row): the replica is one model, sharded, so its checkpoint is one DCP
checkpoint, as FSDP2's own are. Each replica keeps its own checkpoint because the replicas differ (gossip keeps
them close, not equal); to keep one model, save it from inside ``model.averaged()`` with DCP directly.

What a replica's directory holds:

* its trainable and frozen parameters (``parameters.<name>``, ``frozen.<name>``) and the optimizer's tensors
  that are sharded like them (``optimizer.state.<i>.exp_avg`` ...) as DTensor entries: DCP stores their local
  shards with the global shapes, so any DCP reader loads them at any layout (e.g. into a full tensor on one
  process, or an FSDP2 model of another G);
* each rank's own state under ``lane<j>.``, j its shard index: the algorithm's state (PowerGossip's per-edge
  factors of this lane's blocks), the step counter, the RNG streams, the buffers, the optimizer's unsharded
  entries (``step``, the param groups), the ``extra`` state, and the structure that ties the tensors together
  (``lane<j>.gossip.structure``, a ``torch.save`` of plain data, loaded weights-only as :mod:`gossip.checkpoint.dcp`
  does).

The flat buckets of x_t that the unsharded checkpoint saves are not saved: the sharded wrapper's staging copy
equals the local shards after each step, so a load rebuilds it from the loaded parameters. Resuming therefore needs
the same R × G layout (each lane's algorithm state belongs to its shard of the rows), the same model, schedule,
algorithm and settings, as for :func:`gossip.checkpoint.load_checkpoint`; what a resumed run computes is then
bit-identical to the uninterrupted run.

Both functions are collectives over the world, with the two-phase commit and the errors of
:func:`gossip.checkpoint.save_checkpoint` / :func:`gossip.checkpoint.load_checkpoint`: every rank writes its part
of its replica's temporary directory ``.replica<r>.dcp.<random>.tmp``; only if every rank of every replica wrote
its part does shard 0 of each replica rename it in place (the previous one moved aside, then removed), else every
rank raises :class:`~gossip.errors.CheckpointWriteError` and every previous checkpoint stays. A load raises
:class:`~gossip.errors.CheckpointMismatchError` on every rank when a replica's directory is missing, unreadable,
of another run or layout, or of another save.
"""

from __future__ import annotations

import io
import pickle
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gossip.checkpoint.agreement import capture_state, raise_gathered, write_failure
from gossip.checkpoint.async_save import wait_pending
from gossip.checkpoint.dcp import _join, _replace_directory, _split
from gossip.checkpoint.safe_loading import SAFE_GLOBALS, first_unsafe_item, weights_only_refusal
from gossip.checkpoint.save_load import begin_save
from gossip.checkpoint.state import mismatch, restore
from gossip.errors import ArgumentTypeError, CheckpointMismatchError, UntrustedCheckpointError
from gossip.wrapper.shard_layout import is_dtensor
from gossip.wrapper.sharded import ShardedDecentralizedDataParallel

_STRUCTURE = "gossip.structure"


def replica_path(path_dir: str | Path, replica: int) -> Path:
    """Replica ``replica``'s DCP checkpoint directory in ``path_dir``.

    Args:
        path_dir: the checkpoint directory.
        replica: the replica index (the lane rank).

    Returns:
        ``path_dir/replica<r>.dcp``.
    """
    return Path(path_dir) / f"replica{replica}.dcp"


def _require_sharded(model: object, operation: str) -> ShardedDecentralizedDataParallel:
    if not isinstance(model, ShardedDecentralizedDataParallel):
        raise ArgumentTypeError(
            f"{operation} saves sharded replicas (gossip.ShardedDecentralizedDataParallel), got "
            f"{type(model).__name__}; use gossip.checkpoint.save_dcp / load_dcp for unsharded replicas"
        )
    return model


def _group(model: ShardedDecentralizedDataParallel) -> Any:
    """The replica's process group: the one FSDP2 shards its parameters over (checked at construction)."""
    return model._staging.parameters[0].device_mesh.get_group()


def _everyone(model: ShardedDecentralizedDataParallel, value: Any) -> list[Any]:
    """``value`` of every rank of the world, replica by replica (lane gather, then shard gather)."""
    per_lane = model.shard_comm.all_gather_object(model.comm.all_gather_object(value))
    return [item for lane in per_lane for item in lane]


def _like(model: ShardedDecentralizedDataParallel) -> dict[tuple, str]:
    """Each sharding (mesh ranks, placements, global shape) of the module's DTensor parameters -> a parameter name."""
    found: dict[tuple, str] = {}
    for name, parameter in model.module.named_parameters():
        if is_dtensor(parameter):
            found.setdefault(_spec(parameter), name)
    return found


def _spec(tensor: Any) -> tuple:
    return (tuple(tensor.device_mesh.mesh.flatten().tolist()), tuple(map(str, tensor.placements)), tuple(tensor.shape))


def _dcp_state(
    model: ShardedDecentralizedDataParallel, state: dict[str, Any], trusted: bool
) -> dict[str, torch.Tensor]:
    """The replica rank's part of its replica's DCP state: DTensors under their own keys, the rest under lane<j>.

    Raises:
        UntrustedCheckpointError: what is left once the tensors are taken out is not plain data, and not trusted.
        ArgumentTypeError: a DTensor is sharded unlike every parameter.
    """
    lane = f"lane{model.shard_comm.rank}"
    tensors: dict[str, torch.Tensor] = {}
    structure = _split(state, "", tensors)
    unsafe = None if trusted else first_unsafe_item(structure, "state")
    if unsafe is not None:
        where, kind = unsafe
        raise UntrustedCheckpointError(
            f"rank {model._lanes.world_rank}: save_sharded_dcp: {where.replace('state', 'the checkpoint', 1)} is a "
            f"{kind}, which a weights-only load refuses (it would run pickled code): make it plain data, or pass "
            "trusted=True to save_sharded_dcp and to load_sharded_dcp (only for your own checkpoints)"
        )
    like = _like(model)
    sharded: dict[str, tuple[str, str]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if is_dtensor(tensor):
            if _spec(tensor) not in like:
                raise ArgumentTypeError(
                    f"rank {model._lanes.world_rank}: save_sharded_dcp: {key} is a DTensor sharded unlike every "
                    "parameter of the model; only the parameters and the optimizer state sharded like them can be "
                    "saved as DTensors (keep other extra state plain)"
                )
            sharded[key] = (like[_spec(tensor)], str(tensor.dtype).removeprefix("torch."))
            out[key] = tensor
        else:
            out[f"{lane}.{key}"] = tensor
    buffer = io.BytesIO()
    torch.save({"structure": structure, "sharded": sharded, "lane": lane}, buffer)
    out[f"{lane}.{_STRUCTURE}"] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return out


def save_sharded_dcp(
    path_dir: str | Path,
    model: ShardedDecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> Path:
    """Write this rank's part of its replica's checkpoint ``path_dir/replica<r>.dcp``. A collective (the world).

    Call it after ``optimizer.step()`` on every rank at the same step (the module docstring says what is saved).

    Args:
        path_dir: the checkpoint directory (shared by the ranks of a replica).
        model: the sharded wrapper to save.
        optimizer: its optimizer.
        extra: more state (as for :func:`gossip.checkpoint.save_checkpoint`), per rank.
        trusted: allow state that only a pickling (trusted) load restores.

    Returns:
        This replica's directory.

    Raises:
        CheckpointWriteError: on every rank, when a rank could not write its part (no replica's previous
            checkpoint is replaced).
        UntrustedCheckpointError: the state needs ``trusted=True``.
        ArgumentTypeError: ``model`` is not sharded, or an ``extra`` value cannot be saved.
    """
    import torch.distributed.checkpoint as dcp

    model = _require_sharded(model, "save_sharded_dcp()")
    begin_save(model, "save_sharded_dcp()")
    replica, shard, step = model.comm.rank, model.shard_comm.rank, model.step_count
    path = replica_path(path_dir, replica)
    # DTensors are no plain data to a weights-only torch.load, but DCP stores them as tensors: the check runs on
    # what is left once the tensors are taken out (_dcp_state)
    with model.checkpointing():
        captured, problem = capture_state(model, optimizer, extra, True)
    if captured is not None:
        captured["shard"] = shard
        del captured["training"]["buckets"]  # the staging equals the local shards after the step (saved as such)
        captured["parameters"] = {n: p.detach() for n, p in model.module.named_parameters() if p.requires_grad}
        try:
            state = _dcp_state(model, captured, trusted)
        except ArgumentTypeError as error:
            state, problem = None, ("TypeError", str(error))
        except UntrustedCheckpointError as error:
            state, problem = None, ("untrusted", str(error))
        del captured
    temporary = None
    if shard == 0 and problem is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for stale in path.parent.glob(f".{path.name}.*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            temporary = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        except OSError as error:
            problem = ("write", write_failure(model._lanes.world_rank, path, error, step))
    # the replica's ranks write one directory: shard 0 names it; a problem anywhere stops every rank here
    named = model.shard_comm.all_gather_object((temporary, problem))
    problems = _everyone(model, next((p for _, p in named if p is not None), None))
    if any(p is not None for p in problems) and temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    raise_gathered(problems, "")
    temporary = named[0][0]
    try:
        dcp.save(state, checkpoint_id=temporary, process_group=_group(model))
    except Exception as error:
        cause = error
        while cause.__cause__ is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        problem = ("write", write_failure(model._lanes.world_rank, path, cause, step))
    del state
    problems = _everyone(model, problem)
    if any(p is not None for p in problems):
        if shard == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise_gathered(problems, "no replica replaced its previous checkpoint")
    problem = None
    if shard == 0:
        try:
            _replace_directory(Path(temporary), path)
        except OSError as error:
            shutil.rmtree(temporary, ignore_errors=True)
            problem = ("write", write_failure(model._lanes.world_rank, path, error, step))
    raise_gathered(
        _everyone(model, problem),
        "the other replicas hold the new checkpoint, the directories are now of different saves: save again",
    )
    return path


def _read(model: ShardedDecentralizedDataParallel, path: Path, trusted: bool) -> dict[str, Any]:
    """This rank's state from its replica's directory (two DCP loads over the replica's group: the lane's plain
    entries with the structure, then the DTensors into tensors sharded like the parameters they name)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    lane = f"lane{model.shard_comm.rank}"
    metadata = dcp.FileSystemReader(path).read_metadata()
    plain = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata) and key.startswith(f"{lane}.")
    }
    if f"{lane}.{_STRUCTURE}" not in plain:
        raise CheckpointMismatchError(
            f"rank {model._lanes.world_rank}: {path} holds no state of shard {model.shard_comm.rank} "
            f"({lane}.{_STRUCTURE}): it was saved with fewer shards per replica; resume with the --shards it was "
            "saved with"
        )
    dcp.load(plain, checkpoint_id=path, process_group=_group(model))
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            saved = torch.load(
                io.BytesIO(plain.pop(f"{lane}.{_STRUCTURE}").numpy().tobytes()), weights_only=not trusted
            )
    except pickle.UnpicklingError as error:
        raise UntrustedCheckpointError(
            f"{path} holds objects that a weights-only load refuses ({weights_only_refusal(error)}): loading it "
            "would run pickled code; pass trusted=True to load_sharded_dcp only if you wrote it yourself"
        ) from error
    parameters = dict(model.module.named_parameters())
    sharded = {
        key: torch.zeros_like(parameters[like], dtype=getattr(torch, dtype))
        for key, (like, dtype) in saved["sharded"].items()
    }
    dcp.load(sharded, checkpoint_id=path, process_group=_group(model))
    tensors = {key.removeprefix(f"{lane}."): tensor for key, tensor in plain.items()} | sharded
    return _join(saved["structure"], tensors)


def _staging_of(model: ShardedDecentralizedDataParallel, parameters: Mapping[str, Any]) -> list[torch.Tensor]:
    """The staging buckets as they hold ``parameters``' local shards (new tensors; the live staging untouched)."""
    buckets = []
    for bucket in model.buckets:
        buffer = bucket.buffer.detach().clone()
        for entry in bucket.entries:
            bucket.view(entry, buffer).copy_(parameters[entry.name].to_local())
        buckets.append(buffer)
    return buckets


def load_sharded_dcp(
    path_dir: str | Path,
    model: ShardedDecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> int:
    """Restore this rank's state from its replica's directory written by :func:`save_sharded_dcp`. A collective.

    The parameters' local shards, the optimizer (DTensor moments included), the algorithm's state, the step, the
    RNG streams, the buffers and ``extra`` come back as saved; the staging is rebuilt from the loaded shards.

    Args:
        path_dir: the checkpoint directory.
        model: the sharded wrapper to restore (same R × G layout, model and settings as the saved run).
        optimizer: its optimizer (fresh or used: its state is replaced).
        extra: the objects to restore in place, under the keys given to :func:`save_sharded_dcp`.
        trusted: unpickle objects other than plain data (only for your own checkpoints).

    Returns:
        The step to resume at.

    Raises:
        CheckpointMismatchError: a replica's directory is missing, unreadable, of another run, layout or save.
        UntrustedCheckpointError: a rank's state needs ``trusted=True``.
        ArgumentTypeError: ``model`` is not sharded.
    """
    model = _require_sharded(model, "load_sharded_dcp()")
    model._require_usable("load_sharded_dcp()")
    wait_pending(model)
    model._settle_exchange()
    extra = dict(extra or {})
    path = replica_path(path_dir, model.comm.rank)
    where = f"rank {model._lanes.world_rank} (replica {model.comm.rank}, shard {model.shard_comm.rank})"
    problem = (
        None
        if path.is_dir()
        else (
            "mismatch",
            f"{where}: no checkpoint directory {path}; pass the directory that save_sharded_dcp wrote, with every "
            "replica's replica<r>.dcp in it",
        )
    )
    raise_gathered_load(_everyone(model, problem))
    state = None
    try:
        state = _read(model, path, trusted)
    except UntrustedCheckpointError as error:
        problem = ("untrusted", f"{where}: {error}")
    except Exception as error:  # DCP's own errors, a truncated directory, a missing lane
        problem = ("mismatch", f"{where}: {path} is unreadable or not this layout's ({type(error).__name__}: {error})")
    if problem is None:
        message = mismatch(path, state, model, extra)
        if message is None and state["shard"] != model.shard_comm.rank:
            message = f"{where}: {path} holds shard {state['shard']}'s state under this shard's lane"
        problem = (
            None if message is None else ("mismatch", f"{where}: {message.removeprefix(f'rank {model.comm.rank}: ')}")
        )
    step = None if state is None else int(state["training"]["step"])
    gathered = _everyone(model, (problem, step))
    raise_gathered_load([p for p, _ in gathered])
    steps = [s for _, s in gathered]
    if len(set(steps)) > 1:
        raise CheckpointMismatchError(
            f"the replicas' checkpoints in {Path(path_dir)} hold different steps ({steps}, rank by rank): they come "
            "from different saves; restore one save's directories"
        )
    assert state is not None
    parameters = state.pop("parameters")
    with torch.no_grad():
        for name, live in model.module.named_parameters():
            if name in parameters:
                live.to_local().copy_(parameters[name].to_local())
    state["training"]["buckets"] = _staging_of(model, parameters)
    with model.checkpointing():
        return restore(state, model, optimizer, extra)


def raise_gathered_load(problems: list[Any]) -> None:
    """Raise the first rank's load problem on every rank (``(kind, message)`` or None per rank).

    Args:
        problems: every rank's problem, as gathered.

    Raises:
        UntrustedCheckpointError: a rank's state needs ``trusted=True``.
        CheckpointMismatchError: any other problem.
    """
    found = [p for p in problems if p is not None]
    if not found:
        return
    kind, message = found[0]
    text = message + (f" (and {len(found) - 1} more rank(s))" if found[1:] else "")
    if kind == "untrusted":
        raise UntrustedCheckpointError(text)
    raise CheckpointMismatchError(text)
