r"""The mean gradient a momentum-tracking optimizer samples for its second moment: by gossip, or by an all-reduce.

A :class:`~gossip.wrapper.momentum.MomentumSource` (:class:`optim.MomentumTrackingAdamW` with
``second_moment_every`` = K > 0) divides its steps by the second moment of the *mean* gradient
:math:`\bar g = \frac1n \sum_j g_j`, sampled every K steps (``optim/momentum_tracking.py`` says why: each rank's own
:math:`E[g_i^2] = \bar g^2 + \sigma^2` is n times too noisy). The wrapper's ``mean_gradient`` chooses how the sample
is formed:

* ``"gossip"`` (:class:`GossipedMeanGradient`, the default): no collective. At the due step s every rank copies its
  gradient into a sample :math:`a_i \leftarrow g_i^s`; from the next step t at which the schedule averages exactly
  (:func:`topologies.exact_averaging_starts`: every step of the one-peer hypercube, the first of each period of a
  Base-(k+1) graph) the samples are mixed over the schedule's own W(t), one step at a time,

  .. math::  a_i \leftarrow \sum_j W_{ij}(t)\, a_j ,

  their exchange posted with the parameters' (it runs during forward and backward) and mixed at the optimizer
  step, summed in rank order. After h hops, :math:`W(t+h-1) \cdots W(t) = J`, so every rank holds
  :math:`\bar g^s` exactly up to rounding, and hands it to the optimizer then (h steps late: log2 n for the
  hypercube, against the 1/(1 - beta2) steps over which the second moment averages). Bytes per rank: h model-sized
  messages per sample, h/K of a model per step. A schedule that never averages exactly (a ring, random matchings)
  mixes for :func:`inexact_hops` steps instead: random matchings halve the expected squared disagreement each step
  (Boyd, Ghosh, Prabhakar & Shah 2006), so after :math:`\lceil\log_2 n\rceil + 3` of them what is left is
  :math:`2^{-3}` of one rank's gradient noise divided by n.
* ``"allreduce"`` (:class:`AllReducedMeanGradient`): one all-reduce of the gradients at the due step, applied at
  once; :math:`2 (n-1)/n` of a model per rank and sample, and a barrier over every rank.

Message precision (``wire_dtype``, the wrapper's ``mean_gradient_dtype``; torch.bfloat16 by default): the gossiped
samples travel in that dtype. Before each hop every rank rounds its own sample to it, in place, sends the rounded
copy, and sums :math:`\sum_j W_{ij}(t)\, \mathrm{rd}(a_j)` in float32 in rank order, its own rounded term included,
so the two ends of a hypercube edge still hold the same values bit for bit and every rank ends with the same mean.
Each hop rounds each value by at most half a unit in the last place, :math:`2^{-8}` of its magnitude for bfloat16
(8 significant bits; normal numbers), so after h hops the mean is exact to :math:`h \cdot 2^{-8}` of the largest
term's magnitude, its square to twice that: the second moment divides the step by its square root, which the
rounding moves by at most about :math:`h \cdot 2^{-8}` of that scale. bfloat16 keeps float32's range, so no
gradient underflows or overflows where float32's would not; the samples' bytes halve.

A sample due while the previous one is still being averaged is refused by name: the optimizer's
``second_moment_every`` must be at least the hops plus the longest wait for an exact start, less one (the hops alone
for the hypercube). Ranks whose optimizers differ never reach a hop that only one end posts: the step's comparison
of optimizers with the same peer (:class:`gossip.wrapper.peer_agreement.PeerAgreement`) is posted before it and
names them first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import Bucket, gradients_into
from gossip.errors import CheckpointMismatchError, InvalidArgumentError
from gossip.wrapper.tracking import TrackerMixing
from topologies import Schedule, exact_averaging_starts

#: The values of the wrapper's ``mean_gradient``.
MEAN_GRADIENT_SOURCES = ("gossip", "allreduce")
#: The values of the wrapper's ``mean_gradient_dtype`` (None: the gradients' own).
MEAN_GRADIENT_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32)


def check_mean_gradient_dtype(owner: str, dtype: object) -> None:
    """Refuse a ``mean_gradient_dtype`` that is not one of :data:`MEAN_GRADIENT_DTYPES`.

    Args:
        owner: who asks, for the message (e.g. ``"rank 3"`` or ``"Pipeline"``).
        dtype: the value given.

    Raises:
        InvalidArgumentError: it is not one of them (the message names ``owner`` and the value).
    """
    if dtype not in MEAN_GRADIENT_DTYPES:
        raise InvalidArgumentError(
            f"{owner}: mean_gradient_dtype must be None or one of torch.bfloat16, torch.float16 and torch.float32, "
            f"got {dtype!r}"
        )


class MeanGradientTaker(Protocol):
    """What a sampler needs of the optimizer (a :class:`~gossip.wrapper.momentum.MomentumSource`)."""

    def mean_gradient_due(self) -> bool:
        """Whether this step samples the mean gradient.

        Returns:
            True on the sampling steps.
        """
        ...

    def take_mean_gradient(self, means: Any, workers: int) -> None:
        """Take one sample of the mean gradient.

        Args:
            means: the mean over the ranks of each parameter's gradient, keyed by the parameter.
            workers: the number of ranks the mean is over.
        """
        ...


def inexact_hops(n: int) -> int:
    """Gossip steps of a sample on a schedule without exact averaging: ceil(log2 n) + 3.

    Random matchings halve the expected squared disagreement per step, so after this many the expected squared
    disagreement is :math:`2^{-3}` of one rank's gradient noise over n, below the mean's own noise (a rank's over n).

    Args:
        n: the number of ranks.

    Returns:
        The number of steps, 0 for one rank.
    """
    return 0 if n <= 1 else math.ceil(math.log2(n)) + 3


class MeanGradientMixing(TrackerMixing):
    """Exact mixing of the samples, a_i <- sum_j W_ij(t) a_j, summed in rank order (as the trackers').

    With a ``wire_dtype`` narrower than the samples' (module docstring, "Message precision"), each hop first rounds
    this rank's sample to it in place, sends the rounded copy, receives the peers' in that dtype and sums every term,
    its own included, in the samples' dtype: both ends of an edge then add the same values in the same order.

    Args:
        nonfinite: what a NaN or Inf received from a peer does: ``"raise"`` or ``"drop"``.
        wire_dtype: the dtype the samples travel in; None: their own.
    """

    name = "mean-gradient"

    def __init__(self, *, nonfinite: str = "raise", wire_dtype: torch.dtype | None = None):
        super().__init__(nonfinite=nonfinite)
        self.wire_dtype = wire_dtype
        self._wire: list[torch.Tensor] = []

    def _narrows(self) -> bool:
        return self.wire_dtype is not None and any(bucket.buffer.dtype != self.wire_dtype for bucket in self.buckets)

    def _buffers(self, count: int) -> list[list[torch.Tensor]]:
        if not self._narrows():
            return super()._buffers(count)
        while len(self._receive_buffers) < count:
            self._receive_buffers.append([torch.empty_like(b.buffer, dtype=self.wire_dtype) for b in self.buckets])
        return self._receive_buffers[:count]

    def _outgoing(self) -> list[torch.Tensor]:
        """This rank's samples rounded to ``wire_dtype``, in place too, so its own term is what its peers receive."""
        if not self._narrows():
            return super()._outgoing()
        if not self._wire:
            self._wire = [torch.empty_like(bucket.buffer, dtype=self.wire_dtype) for bucket in self.buckets]
        for bucket, wire in zip(self.buckets, self._wire, strict=True):
            bucket.buffer.copy_(wire.copy_(bucket.buffer))
        return self._wire


class AllReducedMeanGradient:
    """``mean_gradient="allreduce"``: at each due step, one all-reduce of the gradients (module docstring).

    Args:
        algorithm: the wrapper's bound algorithm (its communicator; its step account books the all-reduce).
        buckets: the wrapper's parameter buckets (the gradients travel in their layout).
        parameters: the trainable parameters, in the order of the buckets' entries.
    """

    gossips = False

    def __init__(self, algorithm: Algorithm, buckets: list[Bucket], parameters: list[torch.Tensor]):
        self.algorithm, self.buckets, self.parameters = algorithm, buckets, parameters

    def rebind(self, algorithm: Algorithm, schedule: Schedule) -> None:
        """Use a new member set's algorithm (elastic runs).

        Args:
            algorithm: the new, bound algorithm.
            schedule: its schedule (unused: the all-reduce needs none).
        """
        self.algorithm = algorithm

    def post(self, step: int) -> None:
        """Nothing travels before the optimizer step.

        Args:
            step: the step being started.
        """

    def take(self, source: MeanGradientTaker, step: int, sample: bool = True) -> None:
        """If the optimizer's sample is due (and ``sample``): all-reduce the gradients and hand it their mean.

        A collective, posted as part of the step (``in_step``: an elastic communicator refuses it during a membership
        change). Every rank asks the same optimizer kind, so every rank joins.

        Args:
            source: the optimizer.
            step: the step.
            sample: False skips this step's sample even when it is due (an elastic step whose sample a change
                interrupted).
        """
        if not (sample and source.mean_gradient_due()):
            return
        flats = [torch.zeros_like(bucket.buffer) for bucket in self.buckets]
        means = gradients_into(self.buckets, self.parameters, flats)  # averaged in place below
        handles = [self.algorithm._all_reduce(flat, "avg", in_step=True) for flat in flats]
        for handle in handles:
            self.algorithm._wait(handle)
        source.take_mean_gradient(means, self.algorithm.comm.size)

    def drain(self) -> None:
        """Nothing outlives a step."""

    def state_dict(self) -> dict[str, Any]:
        """No state between steps.

        Returns:
            An empty dict.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore.

        Args:
            state: what :meth:`state_dict` returned.
        """


class GossipedMeanGradient:
    """``mean_gradient="gossip"``: the sample averaged by gossip over the schedule, then applied (module docstring).

    Args:
        algorithm: the wrapper's bound algorithm; the samples' exchanges book into its step account.
        schedule: the wrapper's schedule, whose W(t) mixes the samples.
        buckets: the wrapper's parameter buckets (the samples take their layout).
        parameters: the trainable parameters, in the order of the buckets' entries.
        wire_dtype: the dtype the samples travel in (module docstring, "Message precision"); None: the gradients'.
    """

    gossips = True

    def __init__(
        self,
        algorithm: Algorithm,
        schedule: Schedule,
        buckets: list[Bucket],
        parameters: list[Any],
        wire_dtype: torch.dtype | None = None,
    ):
        self.buckets, self.parameters, self.wire_dtype = buckets, parameters, wire_dtype
        self.samples: list[Bucket] | None = None  # allocated at the first sample
        self.remaining = 0  # hops left of the sample in progress (0: none in progress)
        self.begin_at = 0  # the first step the sample in progress may hop at
        self._sampled: list[int] = []  # positions of the parameters that had a gradient when the sample was taken
        self._pending: Any = None  # the hop in flight
        self.rebind(algorithm, schedule)

    def rebind(self, algorithm: Algorithm, schedule: Schedule) -> None:
        """Mix over a new schedule and algorithm (construction, elastic member sets); a sample in progress is dropped.

        Args:
            algorithm: the bound algorithm whose step account the hops book into.
            schedule: the schedule whose W(t) mixes the samples.
        """
        self._pending, self.remaining = None, 0
        self.algorithm, self.schedule = algorithm, schedule
        starts = exact_averaging_starts(schedule)
        self.exact = bool(starts)
        self.hops = max(starts.values()) if starts else inexact_hops(schedule.n)
        self._starts = set(starts) if starts else None  # None: any phase
        period = schedule.period or 1
        self.longest_wait = max(self._first_hop_after(s) - s for s in range(period)) if self._starts else 1
        self.mixing = MeanGradientMixing(nonfinite=algorithm.nonfinite, wire_dtype=self.wire_dtype)
        if self.samples is not None:
            algorithm.setup_part(self.mixing, schedule, self.samples)

    def _first_hop_after(self, step: int) -> int:
        t = step + 1
        while self._starts is not None and self.schedule.phase(t) not in self._starts:
            t += 1
        return t

    def post(self, step: int) -> None:
        """Post step ``step``'s hop of the sample in progress, if one is due (right after the parameters' exchange).

        Args:
            step: the step being started, the same on every rank.
        """
        if self.remaining and step >= self.begin_at and self._pending is None:
            self._pending = self.mixing.start(step)

    def take(self, source: MeanGradientTaker, step: int, sample: bool = True) -> None:
        """At the optimizer step: finish this step's hop, then sample the gradients if the optimizer's sample is due.

        The hop that makes the sample exact hands its mean over (:meth:`MeanGradientTaker.take_mean_gradient`).

        Args:
            source: the optimizer.
            step: the step, the same on every rank.
            sample: False skips a new sample this step even when it is due.

        Raises:
            InvalidArgumentError: a sample is due while the previous one is still being averaged (the optimizer's
                ``second_moment_every`` is below the hops it needs).
        """
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.mixing.finish(pending)
            self.remaining -= 1
            if not self.remaining:
                self._hand_over(source)
        if not (sample and source.mean_gradient_due()):
            return
        if self.remaining:
            needed = self.hops + self.longest_wait - 1
            raise InvalidArgumentError(
                f"step {step}: rank {self.algorithm.comm.rank}: the optimizer samples the mean gradient again while "
                f"the last sample still needs {self.remaining} of its {self.hops} gossip steps over "
                f"'{self.schedule.name}'; raise its second_moment_every to at least {needed}, or pass "
                "mean_gradient='allreduce' to the wrapper"
            )
        if self.samples is None:
            self.samples = [Bucket(torch.zeros_like(bucket.buffer), bucket.entries) for bucket in self.buckets]
            self.algorithm.setup_part(self.mixing, self.schedule, self.samples)
        taken = gradients_into(self.buckets, self.parameters, [sample.buffer for sample in self.samples])
        self._sampled = [index for index, p in enumerate(self.parameters) if p in taken]
        self.remaining, self.begin_at = self.hops, self._first_hop_after(step)
        if not self.remaining:  # one rank: its gradient is the mean
            self._hand_over(source)

    def _hand_over(self, source: MeanGradientTaker) -> None:
        assert self.samples is not None
        views = [sample.view(entry) for sample in self.samples for entry in sample.entries]
        source.take_mean_gradient({self.parameters[i]: views[i] for i in self._sampled}, self.algorithm.comm.size)

    def drain(self) -> None:
        """Complete a hop in flight and drop its result (``close()``, a checkpoint being loaded)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.mixing.finish(pending)

    def state_dict(self) -> dict[str, Any]:
        """The sample in progress, for a checkpoint (a hop in flight is posted again by the resumed run).

        Returns:
            ``{"remaining", "begin_at", "sampled", "samples"}``; ``samples`` is None before the first.
        """
        samples = None if self.samples is None else [s.buffer.detach().clone() for s in self.samples]
        return {
            "remaining": self.remaining,
            "begin_at": self.begin_at,
            "sampled": list(self._sampled),
            "samples": samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: the saved state.

        Raises:
            CheckpointMismatchError: the saved samples do not have this run's bucket layout.
        """
        self.drain()
        saved: Sequence[torch.Tensor] | None = state.get("samples")
        if saved is not None:
            if self.samples is None:
                self.samples = [Bucket(torch.zeros_like(bucket.buffer), bucket.entries) for bucket in self.buckets]
                self.algorithm.setup_part(self.mixing, self.schedule, self.samples)
            if [(t.shape, t.dtype) for t in saved] != [(s.buffer.shape, s.buffer.dtype) for s in self.samples]:
                raise CheckpointMismatchError(
                    f"rank {self.algorithm.comm.rank}: the saved samples of the mean gradient do not have this run's "
                    "bucket layout"
                )
            for sample, value in zip(self.samples, saved, strict=True):
                sample.buffer.copy_(value)
        self.remaining, self.begin_at, self._sampled = int(state["remaining"]), int(state["begin_at"]), state["sampled"]


def make_mean_gradient(
    option: str,
    algorithm: Algorithm,
    schedule: Schedule,
    buckets: list[Bucket],
    parameters: list[torch.Tensor],
    wire_dtype: torch.dtype | None = None,
) -> AllReducedMeanGradient | GossipedMeanGradient:
    """The sampler for the wrapper's ``mean_gradient`` option.

    Args:
        option: one of :data:`MEAN_GRADIENT_SOURCES`.
        algorithm: the wrapper's bound algorithm.
        schedule: the wrapper's schedule.
        buckets: the wrapper's parameter buckets.
        parameters: the trainable parameters, in the order of the buckets' entries.
        wire_dtype: the dtype a gossiped sample travels in (None: the gradients'); the all-reduce ignores it.

    Returns:
        The sampler.

    Raises:
        InvalidArgumentError: ``option`` is not one of :data:`MEAN_GRADIENT_SOURCES`.
    """
    if option == "gossip":
        return GossipedMeanGradient(algorithm, schedule, buckets, parameters, wire_dtype)
    if option == "allreduce":
        return AllReducedMeanGradient(algorithm, buckets, parameters)
    raise InvalidArgumentError(f"mean_gradient must be one of {MEAN_GRADIENT_SOURCES}, got {option!r}")
