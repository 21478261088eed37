"""Checks that every rank trains the same model the same way, and the broadcast that makes the replicas equal.

Before the first step :func:`check_replicas` gathers a compact description of every rank's run -- parameter and
buffer names, shapes, dtypes and device types, the schedule's fingerprint, the algorithm's name and config, and
the wrapper's own settings that must agree (``bucket_bytes``, the ``buffers`` policy, the consensus sampling
``seed``, ...) -- with one ``all_gather_object`` and compares every rank's with rank 0's. A mismatch raises
:class:`ReplicaMismatchError` on *every* rank (all ranks see the same gathered list), naming the first difference
and the rank that has it, so no rank is left waiting in a later collective. A parameter frozen
(``requires_grad=False``) on some ranks only is named as such. A schedule for another world size, a lazy module
not materialised yet and a model with nothing to gossip (no trainable parameter, or only empty ones) are refused
the same way. Parameters with 0 elements among others are accepted: they travel as nothing.
:func:`broadcast_from_rank0` then copies rank 0's parameters (frozen ones too, as DDP does) and buffers to every
rank, as Decent-DP does at setup (docs/design.md B.1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import Bucket
from gossip.backends.base import Communicator
from gossip.errors import ReplicaMismatchError
from gossip.wrapper.consensus import _all_reduce_on
from topologies import Schedule


def algorithm_config(algorithm: Algorithm) -> dict[str, Any]:
    """The algorithm's name and hyper-parameters (:meth:`gossip.algorithms.base.Algorithm.config`).

    Args:
        algorithm: the algorithm to describe.

    Returns:
        ``{"name": ..., **config}``, comparable across ranks.
    """
    return {"name": algorithm.name, **algorithm.config()}


def tensor_signature(module: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...], str, str]]:
    """``(kind, name, shape, dtype, device type)`` for every parameter and every buffer, in order.

    ``kind`` is ``"parameter"`` for a trainable parameter and ``"frozen parameter"`` for one with
    ``requires_grad=False`` (broadcast from rank 0 at construction, never gossiped).

    Args:
        module: the model.

    Returns:
        One tuple per parameter and buffer.
    """
    rows = [
        (
            "parameter" if p.requires_grad else "frozen parameter",
            name,
            _shape(p),
            str(p.dtype).removeprefix("torch."),
            p.device.type,
        )
        for name, p in module.named_parameters()
    ]
    rows += [
        ("buffer", name, _shape(b), str(b.dtype).removeprefix("torch."), b.device.type)
        for name, b in module.named_buffers()
    ]
    return rows


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return () if is_lazy(tensor) else tuple(tensor.shape)


def is_lazy(tensor: torch.Tensor) -> bool:
    """True for a parameter or buffer of a lazy module (``nn.LazyLinear``) not materialised by a forward yet.

    Args:
        tensor: a parameter or buffer.

    Returns:
        Whether it is still uninitialised.
    """
    return isinstance(tensor, UninitializedTensorMixin)


def run_signature(
    module: torch.nn.Module,
    comm: Communicator,
    schedule: Schedule,
    algorithm: Algorithm,
    settings: dict[str, Any] | None = None,
) -> dict:
    """What must be equal on every rank (and in a checkpoint that this run resumes).

    Args:
        module: the model.
        comm: the communicator (its size is part of the signature).
        schedule: the schedule (its fingerprint).
        algorithm: the algorithm (its config).
        settings: the wrapper's own options that every rank must share (``bucket_bytes``, ``buffers``, ``seed``,
            ...), compared at construction like the parameters.

    Returns:
        The signature, a dict of plain data.
    """
    return {
        "world_size": comm.size,
        "schedule": {"name": schedule.name, "n": schedule.n, "fingerprint": schedule.fingerprint()},
        "algorithm": algorithm_config(algorithm),
        "settings": dict(settings or {}),
        "tensors": tensor_signature(module),
    }


def first_difference(
    mine: dict, reference: dict, who: str, reference_who: str, settings: Iterable[str] | None = None
) -> str | None:
    """A sentence naming the first item in which ``mine`` differs from ``reference``, or None when equal.

    Args:
        mine: a signature (:func:`run_signature`).
        reference: the signature to compare with.
        who: how the sentence names ``mine`` (e.g. ``"rank 1"``).
        reference_who: how it names ``reference`` (e.g. ``"rank 0"``).
        settings: the names of the wrapper settings to compare (default all of them).

    Returns:
        The sentence, or None when the signatures agree.
    """
    if mine["world_size"] != reference["world_size"]:
        return f"{who} has world size {mine['world_size']} but {reference_who} has {reference['world_size']}"
    if mine["schedule"] != reference["schedule"]:
        a, b = mine["schedule"], reference["schedule"]
        return (
            f"{who} uses schedule {a['name']}(n={a['n']}, fingerprint {a['fingerprint'][:12]}) but {reference_who} "
            f"uses {b['name']}(n={b['n']}, fingerprint {b['fingerprint'][:12]})"
        )
    if mine["algorithm"] != reference["algorithm"]:
        return f"{who} uses algorithm {mine['algorithm']} but {reference_who} uses {reference['algorithm']}"
    ours_settings, their_settings = mine.get("settings", {}), reference.get("settings", {})
    for key in sorted(set(ours_settings) | set(their_settings)) if settings is None else settings:
        if ours_settings.get(key) != their_settings.get(key):
            return (
                f"{who} uses {key}={ours_settings.get(key)!r} but {reference_who} uses {their_settings.get(key)!r}; "
                f"pass the same {key} on every rank"
            )
    ours, theirs = mine["tensors"], reference["tensors"]
    for row, other in zip(ours, theirs, strict=False):
        if row == other:
            continue
        kind, name, shape, dtype, device = row
        if name == other[1] and {kind, other[0]} == {"parameter", "frozen parameter"}:
            state = {"parameter": "trainable (requires_grad=True)", "frozen parameter": "frozen (requires_grad=False)"}
            return (
                f"{who}: parameter '{name}' is {state[kind]} but on {reference_who} it is {state[other[0]]}; "
                "freeze the same parameters on every rank"
            )
        if (kind, name) != other[:2]:
            return f"{who} has {kind} '{name}' where {reference_who} has {other[0]} '{other[1]}'"
        return (
            f"{who}: {kind} '{name}' is {dtype}{list(shape)} on {device} but on {reference_who} it is "
            f"{other[3]}{list(other[2])} on {other[4]}"
        )
    if len(ours) != len(theirs):
        longer, extra = (who, ours[len(theirs)]) if len(ours) > len(theirs) else (reference_who, theirs[len(ours)])
        return f"{longer} has an extra {extra[0]} '{extra[1]}' ({len(ours)} vs {len(theirs)} tensors)"
    return None


def check_replicas(
    module: torch.nn.Module,
    comm: Communicator,
    schedule: Schedule,
    algorithm: Algorithm,
    settings: dict[str, Any] | None = None,
) -> dict:
    """Check that all ranks agree on the model, schedule, algorithm and settings. A collective.

    Args:
        module: the model.
        comm: the communicator.
        schedule: the schedule.
        algorithm: the algorithm.
        settings: the wrapper settings every rank must share.

    Returns:
        This rank's signature (:func:`run_signature`).

    Raises:
        ReplicaMismatchError: on every rank, when any rank differs from rank 0; names the rank and the item.
    """
    problem = None
    trainable = [p for p in module.parameters() if p.requires_grad]
    lazy = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if lazy:
        problem = (
            f"'{lazy[0]}' of the {type(module).__name__} is not materialised yet (a lazy module such as "
            "nn.LazyLinear): run one forward pass on a sample batch before wrapping, so that every parameter has "
            "its shape"
        )
    elif schedule.n != comm.size:
        problem = f"schedule '{schedule.name}' is built for n={schedule.n} ranks but the world has {comm.size}"
    elif not trainable:
        problem = f"the {type(module).__name__} has no trainable parameters (requires_grad=True): nothing to gossip"
    elif sum(p.numel() for p in trainable) == 0:
        problem = f"every trainable parameter of the {type(module).__name__} has 0 elements: nothing to gossip"
    mine = run_signature(module, comm, schedule, algorithm, settings)
    gathered = comm.all_gather_object((mine, problem))
    for rank, (signature, rank_problem) in enumerate(gathered):
        if rank_problem is not None:
            raise ReplicaMismatchError(f"rank {rank}: {rank_problem}")
        difference = first_difference(signature, gathered[0][0], f"rank {rank}", "rank 0")
        if difference is not None:
            raise ReplicaMismatchError(difference)
    return mine


def broadcast_from_rank0(module: torch.nn.Module, buckets: list[Bucket], comm: Communicator) -> None:
    """Copy rank 0's parameters (the flat buckets), frozen parameters and buffers into every rank's replica.

    Frozen parameters (``requires_grad=False``) are not gossiped; like ``DistributedDataParallel`` the wrapper
    broadcasts them once here, so every rank starts from rank 0's values. A collective.

    Args:
        module: the model.
        buckets: its flat parameter buckets.
        comm: the communicator.
    """
    for bucket in buckets:
        comm.broadcast(bucket.buffer, 0)
    frozen = [p for _, p in module.named_parameters() if not p.requires_grad]
    with torch.no_grad():
        for buffer in [*frozen, *(b for _, b in module.named_buffers())]:
            contiguous = buffer if buffer.is_contiguous() else buffer.contiguous()
            comm.broadcast(contiguous, 0)
            if contiguous is not buffer:
                buffer.copy_(contiguous)


def digests_agree(comm: Communicator, digest: bytes) -> bool:
    """Whether every rank passed the same ``digest``, with one all-reduce of two float64 values (a collective).

    Each rank contributes v = 20 bits of ``digest`` and v squared; the sums are exact in float64, and every rank
    finds sum(v) = n v and sum(v^2) = n v^2 exactly iff all v are equal (zero variance). A false agreement needs two
    digests equal in those 20 bits; a caller that finds disagreement asks the ranks which one differs.

    Args:
        comm: the communicator over the ranks.
        digest: this rank's digest (e.g. a SHA-256), at least 3 bytes.

    Returns:
        True on every rank when all digests' 20 bits agree, else False on every rank.
    """
    value = float(int.from_bytes(digest[:3], "little") >> 4)
    sums = torch.tensor([value, value * value], dtype=torch.float64)
    _all_reduce_on(comm, sums, "sum")
    n = comm.size
    return float(sums[0]) == n * value and float(sums[1]) == n * value * value
