r"""The mean gradient a momentum-tracking optimizer samples for its second moment: by gossip, or by an all-reduce.

A :class:`~gossip.wrapper.momentum.MomentumSource` (:class:`optim.MomentumTrackingAdamW` with
``second_moment_every`` = K > 0) divides its steps by the second moment of the *mean* gradient
:math:`\bar g = \frac1n \sum_j g_j`, sampled every K steps (``optim/momentum_tracking.py`` says why: each rank's own
:math:`E[g_i^2] = \bar g^2 + \sigma^2` is n times too noisy). What is sampled is a window's mean: every rank sums its
gradients over the steps since its previous sample was handed over (:class:`GradientWindow`), and on the due step s
divides the sum by the steps summed, L:

.. math::  w_i = \frac1L \sum_{t = s-L+1}^{s} g_i^t, \qquad \bar w = \frac1n \sum_j w_j ,

whose square has the noise of n L gradients instead of n (a parameter without a gradient at a step adds nothing
that step). The wrapper's ``mean_gradient`` chooses how :math:`\bar w` is formed:

* ``"gossip"`` (:class:`GossipedMeanGradient`, the default): no collective. The window is summed in the sample's own
  buffer :math:`a_i` while no sample is in progress; at the due step :math:`a_i \leftarrow w_i`, and from the next
  step t at which the schedule averages exactly (:func:`topologies.exact_averaging_starts`: every step of the
  one-peer hypercube, the first of each period of a Base-(k+1) graph) the samples are mixed over the schedule's own
  W(t), one step at a time,

  .. math::  a_i \leftarrow \sum_j W_{ij}(t)\, a_j ,

  their exchange posted with the parameters' (it runs during forward and backward) and mixed at the optimizer
  step, summed in rank order. After h hops, :math:`W(t+h-1) \cdots W(t) = J`, so every rank holds
  :math:`\bar w` exactly up to rounding, and hands it to the optimizer then (h steps late: log2 n for the
  hypercube, against the 1/(1 - beta2) steps over which the second moment averages); the buffer then sums the next
  window, from that step on. Bytes per rank: h model-sized messages per sample, h/K of a model per step. A schedule
  that never averages exactly (a ring, random matchings) mixes for :func:`inexact_hops` steps instead: random
  matchings halve the expected squared disagreement each step (Boyd, Ghosh, Prabhakar & Shah 2006), so after
  :math:`\lceil\log_2 n\rceil + 3` of them what is left is :math:`2^{-3}` of one rank's gradient noise divided by n.
* ``"allreduce"`` (:class:`AllReducedMeanGradient`): the window summed in a buffer of its own every step, and one
  all-reduce of its means at the due step, applied at once; :math:`2 (n-1)/n` of a model per rank and sample, and a
  barrier over every rank.

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
    """Exact mixing of the samples, a_i <- sum_j W_ij(t) a_j, summed in rank order (as the trackers')."""

    name = "mean-gradient"


class GradientWindow:
    """Each parameter's gradients summed over the steps since the window was last emptied, in the buckets' layout.

    What a sample of the mean gradient is taken of (module docstring): :meth:`add` at every step, :meth:`average` on
    the due step turns the sums into means in place, :meth:`clear` empties it after the sample is handed over.

    Args:
        buckets: the wrapper's parameter buckets (the sums take their layout).
        parameters: the trainable parameters, in the order of the buckets' entries.
    """

    def __init__(self, buckets: list[Bucket], parameters: list[Any]):
        self.buckets, self.parameters = buckets, parameters
        self.sums: list[Bucket] | None = None  # allocated at the first add
        self.steps = 0  # steps summed since the window was emptied
        self.sampled: list[int] = []  # positions of the parameters that had a gradient in one of them

    def allocate(self) -> list[Bucket]:
        """The sums' buckets, made (zero) at the first call.

        Returns:
            One bucket per parameter bucket, laid out like it.
        """
        if self.sums is None:
            self.sums = [Bucket(torch.zeros_like(bucket.buffer), bucket.entries) for bucket in self.buckets]
        return self.sums

    def add(self) -> None:
        """Add this step's gradients (nothing for a parameter without one)."""
        added = gradients_into(self.buckets, self.parameters, [b.buffer for b in self.allocate()], accumulate=True)
        had = set(self.sampled) | {index for index, p in enumerate(self.parameters) if p in added}
        self.sampled, self.steps = sorted(had), self.steps + 1

    def average(self) -> None:
        """Divide the sums by the steps summed: each rank's mean gradient over the window."""
        for bucket in self.allocate():
            bucket.buffer.div_(max(self.steps, 1))

    def views(self) -> dict[Any, torch.Tensor]:
        """The sums (or means), keyed by the parameters that had a gradient in the window.

        Returns:
            Views of the buffers, one per sampled parameter.
        """
        views = [bucket.view(entry) for bucket in self.allocate() for entry in bucket.entries]
        return {self.parameters[i]: views[i] for i in self.sampled}

    def clear(self) -> None:
        """Empty the window."""
        for bucket in self.sums or []:
            bucket.buffer.zero_()
        self.steps, self.sampled = 0, []

    def state_dict(self) -> dict[str, Any]:
        """The sums so far, for a checkpoint.

        Returns:
            ``{"steps", "sampled", "sums"}``; ``sums`` is None before the first step.
        """
        sums = None if self.sums is None else [b.buffer.detach().clone() for b in self.sums]
        return {"steps": self.steps, "sampled": list(self.sampled), "sums": sums}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: the saved state.
            rank: this rank, for the message.

        Raises:
            CheckpointMismatchError: the saved sums do not have this run's bucket layout.
        """
        saved: Sequence[torch.Tensor] | None = state.get("sums")
        if saved is not None:
            sums = self.allocate()
            if [(t.shape, t.dtype) for t in saved] != [(b.buffer.shape, b.buffer.dtype) for b in sums]:
                raise CheckpointMismatchError(
                    f"rank {rank}: the saved samples of the mean gradient do not have this run's bucket layout"
                )
            for bucket, value in zip(sums, saved, strict=True):
                bucket.buffer.copy_(value)
        self.steps, self.sampled = int(state["steps"]), list(state["sampled"])


class _WindowedSampler:
    """What both samplers share: a :class:`GradientWindow` and the parameters it reads."""

    window: GradientWindow

    @property
    def parameters(self) -> list[Any]:
        """What the window reads ``.grad`` of, in the order of the buckets' entries (the sharded wrapper sets its
        local shards' views)."""
        return self.window.parameters

    @parameters.setter
    def parameters(self, parameters: list[Any]) -> None:
        self.window.parameters = parameters


class AllReducedMeanGradient(_WindowedSampler):
    """``mean_gradient="allreduce"``: at each due step, one all-reduce of the window's mean gradients (module
    docstring).

    Args:
        algorithm: the wrapper's bound algorithm (its communicator; its step account books the all-reduce).
        buckets: the wrapper's parameter buckets (the gradients travel in their layout).
        parameters: the trainable parameters, in the order of the buckets' entries.
    """

    gossips = False

    def __init__(self, algorithm: Algorithm, buckets: list[Bucket], parameters: list[torch.Tensor]):
        self.algorithm = algorithm
        self.window = GradientWindow(buckets, parameters)

    def rebind(self, algorithm: Algorithm, schedule: Schedule) -> None:
        """Use a new member set's algorithm (elastic runs); the window's own gradients are kept.

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
        """Add this step's gradients to the window; if the optimizer's sample is due (and ``sample``): all-reduce the
        window's means and hand the optimizer their mean over the ranks.

        A collective, posted as part of the step (``in_step``: an elastic communicator refuses it during a membership
        change). Every rank asks the same optimizer kind, so every rank joins.

        Args:
            source: the optimizer.
            step: the step.
            sample: False skips this step's sample even when it is due (an elastic step whose sample a change
                interrupted); the window then runs on to the next.
        """
        window = self.window
        window.add()
        if not (sample and source.mean_gradient_due()):
            return
        window.average()
        handles = [self.algorithm._all_reduce(b.buffer, "avg", in_step=True) for b in window.allocate()]
        for handle in handles:
            self.algorithm._wait(handle)
        source.take_mean_gradient(window.views(), self.algorithm.comm.size)
        window.clear()

    def drain(self) -> None:
        """Nothing outlives a step."""

    def state_dict(self) -> dict[str, Any]:
        """The window, for a checkpoint.

        Returns:
            :meth:`GradientWindow.state_dict`'s.
        """
        return self.window.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: the saved state.
        """
        self.window.load_state_dict(state, self.algorithm.comm.rank)


class GossipedMeanGradient(_WindowedSampler):
    """``mean_gradient="gossip"``: the sample averaged by gossip over the schedule, then applied (module docstring).

    The window's sums are the sample's buffers: between a sample's hand-over and the next due step they sum the
    rank's gradients, from the due step on they are mixed, so the window costs no memory beyond the sample.

    Args:
        algorithm: the wrapper's bound algorithm; the samples' exchanges book into its step account.
        schedule: the wrapper's schedule, whose W(t) mixes the samples.
        buckets: the wrapper's parameter buckets (the samples take their layout).
        parameters: the trainable parameters, in the order of the buckets' entries.
    """

    gossips = True

    def __init__(self, algorithm: Algorithm, schedule: Schedule, buckets: list[Bucket], parameters: list[Any]):
        self.window = GradientWindow(buckets, parameters)
        self.remaining = 0  # hops left of the sample in progress (0: none in progress)
        self.begin_at = 0  # the first step the sample in progress may hop at
        self._pending: Any = None  # the hop in flight
        self.rebind(algorithm, schedule)

    def rebind(self, algorithm: Algorithm, schedule: Schedule) -> None:
        """Mix over a new schedule and algorithm (construction, elastic member sets); a sample in progress is dropped
        and the window emptied.

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
        self.mixing = MeanGradientMixing(nonfinite=algorithm.nonfinite)
        self.window.clear()
        if self.window.sums is not None:
            algorithm.setup_part(self.mixing, schedule, self.window.sums)

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
        """At the optimizer step: finish this step's hop, add the gradients to the window when no sample is in
        progress, then turn the window into a sample if the optimizer's is due.

        The hop that makes the sample exact hands its mean over (:meth:`MeanGradientTaker.take_mean_gradient`) and
        empties the window for the next.

        Args:
            source: the optimizer.
            step: the step, the same on every rank.
            sample: False skips a new sample this step even when it is due (the window runs on).

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
        due = sample and source.mean_gradient_due()
        if self.remaining and due:
            needed = self.hops + self.longest_wait - 1
            raise InvalidArgumentError(
                f"step {step}: rank {self.algorithm.comm.rank}: the optimizer samples the mean gradient again while "
                f"the last sample still needs {self.remaining} of its {self.hops} gossip steps over "
                f"'{self.schedule.name}'; raise its second_moment_every to at least {needed}, or pass "
                "mean_gradient='allreduce' to the wrapper"
            )
        if self.remaining:
            return
        if self.window.sums is None:
            self.algorithm.setup_part(self.mixing, self.schedule, self.window.allocate())
        self.window.add()
        if not due:
            return
        self.window.average()
        self.remaining, self.begin_at = self.hops, self._first_hop_after(step)
        if not self.remaining:  # one rank: its gradient is the mean
            self._hand_over(source)

    def _hand_over(self, source: MeanGradientTaker) -> None:
        source.take_mean_gradient(self.window.views(), self.algorithm.comm.size)
        self.window.clear()

    def drain(self) -> None:
        """Complete a hop in flight and drop its result (``close()``, a checkpoint being loaded)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.mixing.finish(pending)

    def state_dict(self) -> dict[str, Any]:
        """The window or the sample in progress, for a checkpoint (a hop in flight is posted again by the resumed run).

        Returns:
            ``{"remaining", "begin_at", "window"}`` (:meth:`GradientWindow.state_dict`).
        """
        return {"remaining": self.remaining, "begin_at": self.begin_at, "window": self.window.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: the saved state.

        Raises:
            CheckpointMismatchError: the saved samples do not have this run's bucket layout.
        """
        self.drain()
        if "window" not in state:
            raise CheckpointMismatchError(
                f"rank {self.algorithm.comm.rank}: the saved sample of the mean gradient has no window (a checkpoint "
                "of an earlier version); resume it with that version"
            )
        had = self.window.sums is not None
        self.window.load_state_dict(state["window"], self.algorithm.comm.rank)
        if not had and self.window.sums is not None:
            self.algorithm.setup_part(self.mixing, self.schedule, self.window.sums)
        self.remaining, self.begin_at = int(state["remaining"]), int(state["begin_at"])


def make_mean_gradient(
    option: str, algorithm: Algorithm, schedule: Schedule, buckets: list[Bucket], parameters: list[torch.Tensor]
) -> AllReducedMeanGradient | GossipedMeanGradient:
    """The sampler for the wrapper's ``mean_gradient`` option.

    Args:
        option: one of :data:`MEAN_GRADIENT_SOURCES`.
        algorithm: the wrapper's bound algorithm.
        schedule: the wrapper's schedule.
        buckets: the wrapper's parameter buckets.
        parameters: the trainable parameters, in the order of the buckets' entries.

    Returns:
        The sampler.

    Raises:
        InvalidArgumentError: ``option`` is not one of :data:`MEAN_GRADIENT_SOURCES`.
    """
    if option == "gossip":
        return GossipedMeanGradient(algorithm, schedule, buckets, parameters)
    if option == "allreduce":
        return AllReducedMeanGradient(algorithm, buckets, parameters)
    raise InvalidArgumentError(f"mean_gradient must be one of {MEAN_GRADIENT_SOURCES}, got {option!r}")
