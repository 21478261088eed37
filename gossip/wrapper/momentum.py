r"""Momentum tracking in the wrapper: the optimizer's first moment, not its gradient, goes through the tracker.

An optimizer that follows :class:`MomentumSource` (:class:`optim.MomentumTrackingAdamW`) asks the wrapper for two
things inside ``optimizer.step()``, after the parameters' mixing and before the gradient tracker (the math:
``optim/momentum_tracking.py``):

1. on the steps :meth:`MomentumSource.mean_gradient_due` names, the mean gradient over the ranks: one all-reduce of
   the gradients in the buckets' layout (a parameter without ``.grad`` contributes zeros), booked to the
   algorithm's step account as a ring all-reduce, then :meth:`MomentumSource.take_mean_gradient`;
2. :meth:`MomentumSource.prepare_momentum`, which writes the rank's first moment into ``.grad``, where the tracker
   (``gradient_tracking=True``) mixes it.

The ranks must agree on the optimizer: a rank that samples the mean gradient while another does not would wait in
the all-reduce, and one tracking first moments beside one tracking gradients would average quantities of different
meaning. At the first optimizer step of a wrapper that tracks, or whose optimizer is a momentum source, the ranks
therefore compare a fingerprint of the optimizer's kind (:func:`gossip.wrapper.replicas.digests_agree`, as the
wrapper's schedule check does) and raise :class:`~gossip.errors.ReplicaMismatchError` naming the rank that differs.
A momentum source in a wrapper that does not track is refused on its own rank before that comparison
(:class:`~gossip.errors.InvalidArgumentError`): a rank with an ordinary optimizer and no tracker beside it never
joins the comparison, and would otherwise leave it waiting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import Bucket, gradients_into
from gossip.backends.base import Communicator
from gossip.errors import ReplicaMismatchError
from gossip.wrapper.replicas import digests_agree


@runtime_checkable
class MomentumSource(Protocol):
    """An optimizer whose first moment the wrapper's tracker mixes (e.g. :class:`optim.MomentumTrackingAdamW`)."""

    second_moment_every: int

    def mean_gradient_due(self) -> bool:
        """Whether this step samples the mean gradient (asked before :meth:`prepare_momentum`).

        Returns:
            True on the steps whose mean gradient the optimizer takes.
        """
        ...

    def take_mean_gradient(self, means: Mapping[torch.Tensor, torch.Tensor], workers: int) -> None:
        """Take one sample of the mean gradient.

        Args:
            means: the mean over the ranks of each parameter's gradient, keyed by the parameter.
            workers: the number of ranks the mean is over.
        """
        ...

    def prepare_momentum(self) -> None:
        """Advance the moments with each parameter's gradient and write the first moment into ``.grad``."""
        ...


def momentum_source(optimizer: torch.optim.Optimizer) -> MomentumSource | None:
    """``optimizer`` if it is a :class:`MomentumSource`, else None.

    Args:
        optimizer: the optimizer about to step.

    Returns:
        The optimizer, typed as a momentum source, or None.
    """
    return optimizer if isinstance(optimizer, MomentumSource) else None


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """What the ranks must agree on about the optimizer.

    Args:
        optimizer: this rank's optimizer.

    Returns:
        A momentum source's class and sampling interval, or that it is an ordinary optimizer (whose class may
            differ between ranks, as it may without momentum tracking).
    """
    source = momentum_source(optimizer)
    if source is None:
        return "an optimizer that steps on .grad (not a momentum source)"
    return f"{type(optimizer).__name__}(second_moment_every={source.second_moment_every})"


def check_optimizer_agreement(comm: Communicator, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Raise on every rank unless all ranks' :func:`optimizer_kind` are equal (a collective).

    Args:
        comm: the wrapper's communicator.
        optimizer: this rank's optimizer.
        step: the step, for the message.

    Raises:
        ReplicaMismatchError: a rank's optimizer differs from rank 0's; the message names both.
    """
    kind = optimizer_kind(optimizer)
    if digests_agree(comm, hashlib.sha256(kind.encode()).digest()):
        return
    kinds = comm.all_gather_object(kind)
    other = next(rank for rank, k in enumerate(kinds) if k != kinds[0])
    raise ReplicaMismatchError(
        f"step {step}: rank {other}'s optimizer is {kinds[other]} where rank 0's is {kinds[0]}: with momentum "
        "tracking every rank must use the same optimizer with the same second_moment_every"
    )


@torch.no_grad()
def prepare_momentum(
    source: MomentumSource,
    algorithm: Algorithm,
    buckets: Sequence[Bucket],
    parameters: Sequence[torch.Tensor],
    sample: bool = True,
) -> None:
    """Phases 1 and 2 of the module docstring: sample the mean gradient if due, then write the first moment.

    A collective on the steps the sampling is due (every rank asks the same optimizer kind, so every rank joins),
    posted as part of the step (``in_step``: an elastic communicator refuses it during a membership change, and the
    change's decision knows who posted it).

    Args:
        source: the optimizer.
        algorithm: the wrapper's bound algorithm (its communicator; its step account books the all-reduce).
        buckets: the wrapper's parameter buckets.
        parameters: the trainable parameters, in the order of the buckets' entries.
        sample: False skips this step's sample even when it is due (an elastic step whose sample a membership
            change interrupted: it is attempted once, on the group the step began in).
    """
    if sample and source.mean_gradient_due():
        flats = [torch.zeros_like(bucket.buffer) for bucket in buckets]
        means = gradients_into(buckets, parameters, flats)  # averaged in place below
        handles: list[Any] = [algorithm._all_reduce(flat, "avg", in_step=True) for flat in flats]
        for handle in handles:
            algorithm._wait(handle)
        source.take_mean_gradient(means, algorithm.comm.size)
    source.prepare_momentum()
