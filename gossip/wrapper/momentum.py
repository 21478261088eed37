r"""Momentum tracking in the wrapper: the optimizer's first moment, not its gradient, goes through the tracker.

An optimizer that follows :class:`MomentumSource` (:class:`optim.MomentumTrackingAdamW`) asks the wrapper for two
things inside ``optimizer.step()``, after the parameters' mixing and before the gradient tracker (the math:
``optim/momentum_tracking.py``):

1. on the steps :meth:`MomentumSource.mean_gradient_due` names, a sample of the mean gradient over the ranks, for
   :meth:`MomentumSource.take_mean_gradient`: averaged by gossip over the schedule and handed over a few steps later
   (``mean_gradient="gossip"``, the default), or all-reduced at once (``"allreduce"``), in the buckets' layout (a
   parameter without ``.grad`` contributes zeros); :mod:`gossip.wrapper.mean_gradient` has both;
2. :meth:`MomentumSource.prepare_momentum`, which writes the rank's first moment into ``.grad``, where the tracker
   (``gradient_tracking=True``) mixes it. On a step with gradients, a parameter the step did not reach is given a
   zero ``.grad`` first (:meth:`gossip.wrapper.tracking.GradientTracker.fill_missing_gradients`): the zero gradient
   the tracker counts it as, so that its first moment decays and counts the step like every other's.

The ranks must agree on the optimizer: a rank that samples the mean gradient while another does not would wait for
a peer that never joins, and one tracking first moments beside one tracking gradients would average quantities of
different meaning. From the first optimizer step of a wrapper that tracks, the ranks therefore compare
:func:`optimizer_kind` with their peers over one connected window of the schedule
(:class:`gossip.wrapper.peer_agreement.PeerAgreement`) and raise :class:`~gossip.errors.ReplicaMismatchError` naming
the peer that differs; :func:`check_optimizer_agreement` compares it over every rank at once (elastic runs, before
their first step). A momentum source in a wrapper that does not track is refused on its own rank
(:class:`~gossip.errors.InvalidArgumentError`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

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
        A momentum source's class and where its second moment comes from (the tracker, or samples every so many
            steps), or that it is an ordinary optimizer (whose class may differ between ranks, as it may without
            momentum tracking).
    """
    source = momentum_source(optimizer)
    if source is None:
        return "an optimizer that steps on .grad (not a momentum source)"
    if getattr(source, "tracks_second_moment", False):
        return f"{type(optimizer).__name__}(second_moment='tracker')"
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
