"""Gossip with periodic global averaging: an exact all-reduce mean every ``every`` steps, gossip in between.

Chen et al., "Accelerating Gossip SGD with Periodic Global Averaging" (ICML 2021; their Gossip-PGA): on steps t
with (t + 1) mod H = 0 every replica is replaced by the global mean,

.. math::  x_i \\leftarrow \\bar{x} = \\frac{1}{n} \\sum_j x_j ,

and every other step is a step of the inner algorithm (:math:`x_i \\leftarrow \\sum_j W_{ij}(s) x_j` for exact
gossip, the low-rank correction for PowerGossip). Their analysis bounds the consensus error by whichever is
smaller, the gossip's own term (set by the spectral gap) or a term set by H: the averaging caps the drift that a
sparse or compressed gossip leaves to grow, and shortens the transient stage before the linear speed-up.

The inner algorithm counts its own steps: training step t is its step s = t - (t + 1) // H (the averaging
steps before t are not its steps). So a time-varying schedule still cycles through all of its phases: with
H = 16 on the 4-rank one-peer hypercube (period 2) numbering by t would put every average on the same phase and
leave that phase's edges to the averages alone. An error the inner algorithm raises names its step s, and this
wrapper adds the training step t.

Time line: as :class:`gossip.AllReduce`. ``start`` of an averaging step posts a non-blocking all-reduce of a
copy of every bucket (the parameters stay readable by forward and backward meanwhile); ``finish`` waits and
writes the mean into the buckets. Other steps call the inner algorithm's ``start`` (with its step s) and
``finish``.
The inner algorithm does not run at all on an averaging step: its state (PowerGossip's warm factors and parity
counters) stays as it was, identically on both ends of every edge, and its next step continues from there.

Cost: on averaging steps the all-reduce's bytes, counted as :class:`gossip.AllReduce` counts them,
2 (n - 1) / n * M per rank for a model of M bytes; on average 2 (n - 1) / (n H) * M per step on top of the
inner algorithm's (H - 1) / H share of its own traffic.

Bit-exactness: after an averaging step every rank holds the bits the communicator's all-reduce returns, the same
on all ranks for the simulator, Gloo and MPI (the tests pin it); the sum over ranks is preserved up to that
all-reduce's rounding (one division by n).

Non-finite input: on an averaging step the mean is checked (one ``torch.isfinite(...).all()`` per bucket). If
a replica held NaN or Inf, the wrapper follows the inner algorithm's ``nonfinite`` policy: ``"raise"`` raises
:class:`gossip.errors.NonFiniteError` naming the ranks whose replicas are non-finite and the step; ``"drop"``
averages the finite replicas only (a second, blocking all-reduce), gives that mean to every rank and warns
with :class:`gossip.errors.NonFiniteWarning` naming the dropped ranks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import Bucket
from gossip.algorithms.period import EveryPeriod, PeriodStep
from gossip.backends.base import Communicator
from gossip.backends.comm_thread import Handle
from gossip.errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError, NonFiniteWarning
from topologies import Schedule


@dataclass
class _Averaging:
    step: int
    copies: list[torch.Tensor]
    handles: list[Handle]


class PeriodicAverage(EveryPeriod):
    """Wrap ``inner``: exact global average on steps with (step + 1) % every == 0, ``inner`` on all others.

    ``PeriodicAverage(PowerGossip(rank=4), every=16)`` gossips low-rank differences for 15 steps and averages
    exactly on the 16th. ``every=1`` averages every step (All-Reduce of the parameters). The inner algorithm is
    bound by this wrapper's ``setup`` to the same communicator, schedule and buckets; its state is part of this
    wrapper's ``state_dict``.

    Args:
        inner: the algorithm run on the other steps.
        every: steps between global averages, an integer >= 1.

    Raises:
        ArgumentTypeError: ``inner`` is not a :class:`gossip.Algorithm`.
        InvalidArgumentError: ``every`` is not an integer >= 1.
    """

    name = "periodic-average"
    _label = "PeriodicAverage"

    def __init__(self, inner: Algorithm, every: int):
        if not isinstance(inner, Algorithm):
            raise ArgumentTypeError(f"PeriodicAverage: inner must be a gossip.Algorithm, got {type(inner).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidArgumentError(
                f"PeriodicAverage: every must be an integer >= 1 (steps between global averages), got {every!r}"
            )
        self.every = self._period_length = every
        self.between: Algorithm | None = inner
        self._open: int | None = None
        self._between_before: dict[str, Any] | None = None

    @property
    def inner(self) -> Algorithm:
        """The algorithm run on the steps between the averages (the step loop's ``between``)."""
        assert self.between is not None
        return self.between

    @property
    def needs_symmetric_schedule(self) -> bool:  # type: ignore[override]
        """As the inner algorithm: the averaging steps need no schedule."""
        return self.inner.needs_symmetric_schedule

    @property
    def nonfinite(self) -> str:
        """The inner algorithm's policy for NaN or Inf ("raise" or "drop"); the averaging steps follow it."""
        return self.inner.nonfinite

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        """Bind this wrapper and the inner algorithm to ``comm``, ``schedule`` and ``buckets``.

        The schedule is validated once, here, for both: the inner algorithm's symmetry need is this wrapper's.

        Args:
            comm: this rank's communicator.
            schedule: the gossip schedule of the inner algorithm.
            buckets: the parameter buckets to mix in place.
        """
        super().setup(comm, schedule, buckets)
        self.setup_part(self.inner, schedule, buckets)

    # -- the period end (the step loop: gossip.algorithms.period.EveryPeriod) ----------------------------------
    def _start_period_end(self, step: int) -> _Averaging:
        copies = [bucket.buffer.clone() for bucket in self.buckets]
        return _Averaging(step, copies, [self._all_reduce(copy) for copy in copies])

    def _finish_step_end(self, pending: PeriodStep) -> None:
        averaging = pending.at_period_end
        if averaging is None:
            return
        for handle in averaging.handles:
            self._wait(handle)
        checks = [torch.isfinite(copy).all() for copy in averaging.copies if copy.numel()]
        if checks and not bool(torch.stack(checks).all()):
            self._replace_nonfinite_mean(averaging)
        for bucket, mean in zip(self.buckets, averaging.copies, strict=True):
            bucket.buffer.copy_(mean)

    def _replace_nonfinite_mean(self, pending: _Averaging) -> None:
        """The mean is NaN or Inf: name the ranks whose replicas are, then raise or average the finite ones."""
        finite = all(bool(torch.isfinite(bucket.buffer).all()) for bucket in self.buckets)
        healthy = self.comm.all_gather_object(finite)  # every rank sees the non-finite mean, so all gather
        bad = [rank for rank, ok in enumerate(healthy) if not ok]
        where = f"rank {self.comm.rank}: step {pending.step}: PeriodicAverage's global average is non-finite"
        if not bad:
            raise NonFiniteError(
                f"{where}: every replica is finite but their sum overflows; training has diverged (lower the "
                "learning rate)"
            )
        if len(bad) == len(healthy):
            raise NonFiniteError(f"{where}: every rank's replica holds NaN or Inf (lower the learning rate)")
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"{where}: ranks {bad} hold NaN or Inf; their replicas have diverged (lower the learning rate, or "
                "give the inner algorithm nonfinite='drop' to average the finite replicas only)"
            )
        for copy, bucket in zip(pending.copies, self.buckets, strict=True):
            if finite:
                copy.copy_(bucket.buffer)
            else:
                copy.zero_()
            self.comm.all_reduce(copy, "sum")
            copy.div_(len(healthy) - len(bad))
        warnings.warn(
            f"rank {self.comm.rank}: step {pending.step}: PeriodicAverage dropped the replicas of ranks {bad}, which "
            f"hold non-finite values (NaN or Inf); every rank takes the mean of the other {len(healthy) - len(bad)}",
            NonFiniteWarning,
            stacklevel=3,
        )

    # -- state ----------------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The settings every rank must share: ``every`` and the inner algorithm's name and config.

        Returns:
            Setting name -> value.
        """
        return {"every": self.every, "inner": {"name": self.inner.name, **self.inner.config()}}

    def describe(self) -> dict[str, Any]:
        """The inner algorithm's treatment of the parameters (the averaging steps send every tensor exactly).

        Returns:
            The inner algorithm's description, with ``every``.
        """
        return {"every": self.every, "inner": self.inner.describe()}

    @property
    def state_dict_is_snapshot(self) -> bool:  # type: ignore[override]
        """Whether :meth:`state_dict` is a snapshot: as the inner algorithm's (this wrapper adds a new config)."""
        return self.inner.state_dict_is_snapshot

    def state_dict(self) -> dict[str, Any]:
        """The inner algorithm's state, with this wrapper's config.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        return {"config": self.config(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned, the inner algorithm's included.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: the state was saved with another config.
        """
        if state.get("config") != self.config():
            raise InvalidArgumentError(
                f"rank {self.comm.rank}: PeriodicAverage state was saved with {state.get('config')}, this run uses "
                f"{self.config()}"
            )
        self.inner.load_state_dict(state["inner"])
