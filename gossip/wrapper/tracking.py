r"""Gradient tracking: the optimizer steps on a tracker of the mean gradient instead of its own gradient.

Each rank i keeps a tracker :math:`y_i` of the mean gradient :math:`\bar g = \frac1n \sum_j g_j`, mixed by the
same schedule W(t) as the parameters (adapt-then-combine form; NEXT, Di Lorenzo & Scutari 2016; DIGing, Nedić,
Olshevsky & Shi 2017; Pu & Nedić 2020):

.. math::  y_i^{t} = \sum_j W_{ij}(t)\,\big(y_j^{t-1} + g_j^{t} - g_j^{t-1}\big), \qquad y^{-1} = g^{-1} = 0

so that at step 0 :math:`y_i^0 = \sum_j W_{ij}(0)\, g_j^0`. With column sums of 1
(:math:`\mathbf 1^\top W(t) = \mathbf 1^\top`) summing over i gives :math:`\sum_i y_i^t = \sum_i y_i^{t-1} +
\sum_i g_i^t - \sum_i g_i^{t-1}`, hence by induction :math:`\sum_i y_i^t = \sum_i g_i^t` at every step: the
trackers' mean is the mean gradient exactly (up to float rounding), while the mixing removes the per-rank
deviation from it. A schedule that is not doubly stochastic is therefore refused.

Compressed trackers (``gradient_tracking="powergossip"`` or a :class:`gossip.PowerGossip` instance): the trackers
are mixed by PowerGossip instead (Vogels et al. 2020, Section 3), :math:`y_i \leftarrow z_i + \gamma \sum_j W_{ij}
P_{ij}(z_j - z_i)` with :math:`z = y + g^t - g^{t-1}` and :math:`P_{ij}` the rank-r projection both ends of the
edge share. Each edge's correction is applied with opposite signs at its two ends (antisymmetric), so on a
symmetric W the sum is preserved exactly as with exact mixing, :math:`\sum_i y_i^t = \sum_i g_i^t`, while each
step sends the compressed products instead of the model; what the projection misses of the trackers' differences
stays in them for later steps. The tracker's PowerGossip keeps its own per-edge factors (part of the checkpoint).
With ``gradient_tracking="sign"`` (or a :class:`gossip.ChocoSign` instance) the trackers are mixed by CHOCO-Gossip
with scaled-sign messages (:mod:`gossip.algorithms.choco_sign`): full-rank compression with error feedback, whose
per-edge corrections are antisymmetric too, so the same invariant holds; its per-edge public copies are part of the
checkpoint.

Overlapped tracking (``tracking_overlap=True``): the combine-then-adapt form of DIGing (Nedić, Olshevsky & Shi
2017, Algorithm 1),

.. math::  y_i^{t} = \sum_j W_{ij}(t)\, y_j^{t-1} + g_i^{t} - g_i^{t-1},

mixes the previous trackers, which exist before step t's backward: their exchange starts with the parameters'
right after step t - 1's update and runs during step t's forward and backward, and the pre-step hook only waits for
it and adds this rank's own correction. The same induction gives :math:`\sum_i y_i^t = \sum_i g_i^t` (the
mixing preserves the sum; the corrections add the new gradients and remove the old); what changes is that the
fresh gradients reach the peers one step later. At step 0, :math:`y_i^0 = g_i^0`. Without it (the default,
adapt-then-combine, below) the exchange needs :math:`g^t`, which exists only after the backward, so it cannot start
earlier than the pre-step hook and runs *blocking* there.

Several hops a step (``tracker_hops=k``, adapt-then-combine only): the trackers are mixed k times a step, over
the schedule's next k matrices, after the step's increments are added (multiple consensus rounds per gradient
step, as NEAR-DGD's t consensus steps: Berahas, Bollapragada, Keskar & Wei 2019, "Balancing communication and
computation in distributed optimization", IEEE TAC),

.. math::  y^{t} = W(kt + k - 1) \cdots W(kt + 1)\, W(kt)\, \big(y^{t-1} + g^{t} - g^{t-1}\big),

where :math:`y` stacks the ranks' trackers. Every factor has column sums of 1, so the sum invariant holds as for
one hop; a rank's own last increment, still mostly its own gradient noise, is spread over :math:`2^k` ranks of
the one-peer hypercube (k <= log2 n) instead of 2 before the optimizer reads it, at k times the trackers' bytes. The
parameters keep W(t). Exchange h of step t is numbered :math:`kt + h`: the schedule's step it reads, its
sequence number on the wire and the step its errors name; one hop is the exchange numbered t, as without hops.

The adapt-then-combine tracker's exchange needs :math:`g^t`, which exists only after the backward, so it runs
*blocking* inside the optimizer's pre-step hook, right after the parameters' mixing: one more exchange of model
size per step, not overlapped with computation. The received trackers are summed in rank order (this rank
included), so ranks whose rows of W(t) are equal compute bit-identical trackers (the complete graph, W = J, gives
every rank the same mean gradient).

What the optimizer sees: :meth:`GradientTracker.track` writes :math:`y_i^t` into the parameters' ``.grad`` before
``optimizer.step()`` applies its update, so any ``torch.optim`` optimizer steps on the tracker unchanged. A step
without gradients (every ``.grad`` is None: an update skipped by ``GradScaler``, a mixing-only step) brings no new
gradient (:math:`g^t = g^{t-1}`) and leaves ``.grad`` alone; a parameter without ``.grad`` in a step that has
gradients counts as a zero gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import Bucket
from gossip.algorithms.choco_sign import ChocoSign
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.errors import ArgumentTypeError, CheckpointMismatchError, InvalidArgumentError
from topologies import Schedule
from topologies.validation import find_violation


def require_doubly_stochastic(schedule: Schedule, rank: int) -> None:
    """Refuse ``schedule`` for gradient tracking unless every W(t) it is checked on has rows and columns summing to 1.

    Args:
        schedule: the wrapper's schedule.
        rank: this rank, for the message.

    Raises:
        InvalidArgumentError: some W(t) has a column that does not sum to 1 (the message names the step and rank).
    """
    if not schedule.is_doubly_stochastic:
        violation = find_violation(schedule, "column-stochastic")
        raise InvalidArgumentError(
            f"rank {rank}: gradient_tracking=True needs a doubly stochastic schedule, but '{schedule.name}' is not "
            f"({violation}); the trackers' mean equals the mean gradient only if every W(t) has column sums of 1. "
            "Use weights='metropolis' (or another doubly stochastic schedule), or turn gradient tracking off"
        )


def check_tracker_hops(hops: Any, where: str, overlap: bool = False) -> int:
    """Return ``hops`` if it is a number of tracker exchanges a step the tracker can run, else raise.

    Args:
        hops: the wrapper's ``tracker_hops``.
        where: who was given it, for the message (e.g. ``"rank 3"``).
        overlap: the tracker is the overlapped one (``tracking_overlap=True``), which runs one hop.

    Returns:
        ``hops``.

    Raises:
        InvalidArgumentError: ``hops`` is not an integer >= 1, or is more than 1 with ``overlap``.
    """
    if isinstance(hops, bool) or not isinstance(hops, int) or hops < 1:
        raise InvalidArgumentError(f"{where}: tracker_hops must be an integer >= 1, got {hops!r}")
    if overlap and hops > 1:
        raise InvalidArgumentError(
            f"{where}: tracker_hops={hops} mixes the trackers after the step's gradients arrive, but "
            "tracking_overlap=True mixes them before (one hop, during forward and backward); drop one of the two"
        )
    return hops


#: The names ``gradient_tracking`` accepts besides True/False and an algorithm instance.
TRACKER_MIXINGS = ("exact", "powergossip", "sign")


def tracker_mixing(option: Any) -> Algorithm | None:
    """The algorithm that mixes the trackers for the wrapper's ``gradient_tracking`` option.

    Args:
        option: True or ``"exact"`` (exact mixing), ``"powergossip"`` (``PowerGossip()``'s defaults), ``"sign"``
            (``ChocoSign()``'s defaults) or an unbound :class:`gossip.Algorithm` (e.g. ``PowerGossip(rank=4)``).

    Returns:
        None for exact mixing (:class:`TrackerMixing`), else the algorithm.

    Raises:
        InvalidArgumentError: ``option`` is none of these.
    """
    if option is True or option == "exact":
        return None
    if option == "powergossip":
        return PowerGossip()
    if option == "sign":
        return ChocoSign()
    if isinstance(option, Algorithm):
        return option
    raise InvalidArgumentError(
        f"gradient_tracking must be True, False, one of {TRACKER_MIXINGS} or a gossip.Algorithm for the trackers "
        f"(e.g. gossip.PowerGossip(rank=4)), got {option!r}"
    )


def tracking_setting(option: Any) -> Any:
    """What the ranks must agree on about ``gradient_tracking``: False, ``"exact"``, or the trackers' algorithm.

    Args:
        option: the wrapper's ``gradient_tracking`` argument.

    Returns:
        False, ``"exact"``, or ``{"name": ..., **config}`` of the trackers' algorithm.
    """
    if option is False or option is None:
        return False
    mixing = tracker_mixing(option)
    return "exact" if mixing is None else {"name": mixing.name, **mixing.config()}


class TrackerMixing(ExactGossip):
    """Exact mixing of the trackers, y_i <- sum_j W_ij(t) z_j, summed in rank order (this rank's own term included).

    The part of :class:`GradientTracker` that moves bytes; it is bound as a part of the wrapper's algorithm
    (:meth:`Algorithm.setup_part`), so its bytes and waits are booked into that algorithm's step account.

    Args:
        nonfinite: what a NaN or Inf received from a peer does: ``"raise"`` or ``"drop"`` (the peer's weight
            stays with this rank's own tracker, which breaks the invariant of the sum for that step).
    """

    name = "tracker"

    def __init__(self, *, nonfinite: str = "raise"):
        super().__init__(gamma=1.0, nonfinite=nonfinite)
        self._sum: list[torch.Tensor] = []

    def _combine(self, kept: list[tuple[int, float, list[torch.Tensor]]]) -> None:
        """y_i <- sum_j W_ij z_j over this rank and the ``kept`` (peer, weight, buffers), summed in rank order."""
        me = self.comm.rank
        own = 1.0 - sum(weight for _, weight, _ in kept)
        terms = sorted([(me, own, None), *kept], key=lambda term: term[0])
        if not self._sum:
            self._sum = [torch.empty_like(bucket.buffer) for bucket in self.buckets]
        for index, bucket in enumerate(self.buckets):
            total = self._sum[index]
            total.zero_()
            for _, weight, buffers in terms:
                total.add_(bucket.buffer if buffers is None else buffers[index], alpha=weight)
            bucket.buffer.copy_(total)


class GradientTracker:
    """One rank's gradient tracker y_i and its previous gradient g_i^{t-1}, one flat buffer per parameter bucket.

    See the module docstring for the math and the sources. :class:`~gossip.wrapper.parallel.DecentralizedDataParallel`
    builds one with ``gradient_tracking=True`` and calls :meth:`track` after the parameters' mixing, before the
    optimizer's update.

    Args:
        algorithm: the wrapper's algorithm, already bound; the tracker's exchange books into its step account.
        schedule: the wrapper's schedule, whose W(t) mixes the trackers.
        buckets: the wrapper's parameter buckets (the trackers take their layout).
        parameters: the trainable parameters, in the order of the buckets' entries.
        mixing: the unbound algorithm that mixes the trackers (e.g. :class:`gossip.PowerGossip`), or None for exact
            mixing (:class:`TrackerMixing`).
        overlap: the combine-then-adapt form, whose exchange :meth:`start` posts before the forward (module
            docstring), instead of the blocking adapt-then-combine one.
        option: the wrapper's ``gradient_tracking`` argument, from which :meth:`remake_mixing` makes a fresh
            mixing for a new member set (when it is a name or True).
        hops: the trackers' exchanges a step, each over the schedule's next W (module docstring).

    Raises:
        InvalidArgumentError: the schedule is not doubly stochastic over the steps it is checked on (raised by
            :func:`require_doubly_stochastic`), or not symmetric when ``mixing`` needs it; or ``hops`` is refused
            by :func:`check_tracker_hops`.
        ArgumentTypeError: ``mixing`` is the wrapper's algorithm itself (each needs its own object).
    """

    def __init__(
        self,
        algorithm: Algorithm,
        schedule: Schedule,
        buckets: list[Bucket],
        parameters: list[torch.Tensor],
        mixing: Algorithm | None = None,
        overlap: bool = False,
        option: Any = None,
        hops: int = 1,
    ):
        self.hops = check_tracker_hops(hops, f"rank {algorithm.comm.rank}", overlap)
        require_doubly_stochastic(schedule, algorithm.comm.rank)
        if mixing is algorithm:
            raise ArgumentTypeError(
                f"rank {algorithm.comm.rank}: gradient_tracking was given the wrapper's own algorithm object; the "
                "trackers need an algorithm object of their own (e.g. gossip.PowerGossip(rank=4))"
            )
        if mixing is not None and mixing.needs_symmetric_schedule:
            schedule.validate(symmetric=True)
        self.trackers = [Bucket(torch.zeros_like(bucket.buffer), bucket.entries) for bucket in buckets]
        self.previous = [torch.zeros_like(bucket.buffer) for bucket in buckets]
        self._fresh = [torch.zeros_like(bucket.buffer) for bucket in buckets]
        self._parameters = parameters
        # each parameter's views of the trackers and of the two gradient buffers, made once: g^t is read into
        # _fresh, and _correct swaps _fresh and previous instead of copying one into the other
        self._tracker_views = self._views([tracker.buffer for tracker in self.trackers])
        self._fresh_views, self._previous_views = self._views(self._fresh), self._views(self.previous)
        self.mixing = TrackerMixing(nonfinite=algorithm.nonfinite) if mixing is None else mixing
        algorithm.setup_part(self.mixing, schedule, self.trackers)
        self.overlap = bool(overlap)
        self._pending: Any = None  # the overlapped exchange in flight
        self._mixing_before: dict[str, Any] | None = None  # the mixing's state before that exchange started
        # the adapt-then-combine exchange (its hop, what start returned), while a wait on it was interrupted
        self._blocking: tuple[int, Any] | None = None
        self._option = option if option is True or isinstance(option, str) else None
        self._corrected_at = -1  # the step whose correction y += g^t - g^{t-1} was applied

    def _views(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's view of ``buffers`` (laid out like the trackers), in the parameters' order."""
        return [tracker.view(entry, buffer) for tracker, buffer in zip(self.trackers, buffers, strict=True)
                for entry in tracker.entries]  # fmt: skip

    @property
    def remakeable(self) -> bool:
        """Whether :meth:`remake_mixing` can make the trackers' algorithm: the option was a name or True."""
        return self._option is not None

    def remake_mixing(self) -> Algorithm | None:
        """A fresh, unbound algorithm like the one that mixes the trackers, made from the wrapper's option.

        Returns:
            The algorithm, or None for exact mixing.

        Raises:
            InvalidArgumentError: the option was an algorithm object (not :attr:`remakeable`).
        """
        if self._option is None:
            raise InvalidArgumentError(
                f"rank {self.mixing.comm.rank}: the trackers' algorithm was given as an object and cannot be remade"
            )
        return tracker_mixing(self._option)

    def rebind(self, algorithm: Algorithm, schedule: Schedule, mixing: Algorithm | None) -> None:
        r"""Move the trackers to a new member set (:func:`gossip.wrapper.elastic.rebind`): restart them, fresh mixing.

        A departed rank takes its share :math:`y_j - g_j^{t-1}` with it, so the members' trackers no longer sum to
        their gradients. Every member restarts its tracker at its own last input, :math:`y_i \leftarrow g_i^{t-1}`,
        which makes :math:`\sum_i y_i = \sum_i g_i^{t-1}` hold again over any member set; a joiner's tracker and
        last input are both zero, so its first step adds its gradient, as step 0 does. The induction of the module
        docstring then holds from the new member set's first step on. An exchange in flight is dropped unapplied;
        the trackers' algorithm starts with no per-edge state.

        Args:
            algorithm: the wrapper's new algorithm, already bound (the trackers' exchange books into its account).
            schedule: the new member set's schedule.
            mixing: a fresh, unbound algorithm for the trackers, or None for exact mixing.

        Raises:
            InvalidArgumentError: the schedule is not doubly stochastic, or not symmetric when ``mixing`` needs it.
        """
        require_doubly_stochastic(schedule, algorithm.comm.rank)
        if mixing is not None and mixing.needs_symmetric_schedule:
            schedule.validate(symmetric=True)
        self._pending = self._mixing_before = self._blocking = None
        with torch.no_grad():
            for tracker, previous in zip(self.trackers, self.previous, strict=True):
                tracker.buffer.copy_(previous)
        self.mixing = TrackerMixing(nonfinite=algorithm.nonfinite) if mixing is None else mixing
        algorithm.setup_part(self.mixing, schedule, self.trackers)

    def start(self, step: int) -> None:
        """Overlapped tracking: post step ``step``'s exchange of y^{t-1} over W(t) (a no-op otherwise).

        The wrapper calls it right after the parameters' exchange starts, so it runs during forward and backward.

        Args:
            step: the step's number, the same on every rank.
        """
        if not self.overlap or self._pending is not None:
            return
        self._mixing_before = self.mixing.state_snapshot()
        self._pending = self.mixing.start(step)

    def drain(self) -> None:
        """Complete an overlapped exchange in flight and drop its result (``close()``; every rank calls it)."""
        self._blocking = None  # only left by an interrupted wait, on a communicator being given up
        pending, self._pending = self._pending, None
        if pending is not None:
            self.mixing.finish(pending)
            self._mixing_before = None

    def _correct(self, step: int) -> None:
        """y_i += g_i^t - g_i^{t-1}; g^{t-1} <- g^t (the two buffers swap); recorded as step ``step``'s correction."""
        for tracker, previous, fresh in zip(self.trackers, self.previous, self._fresh, strict=True):
            tracker.buffer.add_(fresh).sub_(previous)
        self.previous, self._fresh = self._fresh, self.previous
        self._previous_views, self._fresh_views = self._fresh_views, self._previous_views
        self._corrected_at = step

    def fill_missing_gradients(self) -> None:
        """Give each parameter without ``.grad`` a zero one, on a step where another has a gradient.

        The zero gradient :meth:`track` counts it as, made visible before the tracker runs: a momentum source's
        first moment (:mod:`gossip.wrapper.momentum`) then decays with it and counts the step, as the tracked
        first moments of the ranks that did use the parameter do. A step without any gradient is left as it is.
        """
        if not any(p.grad is not None for p in self._parameters):
            return
        for parameter, view in zip(self._parameters, self._tracker_views, strict=True):
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(view)  # laid out as the tracker reads it (a local shard)

    def _read_gradients(self) -> None:
        """g^t <- each parameter's ``.grad`` (a missing one counts as 0), into the fresh buffers."""
        for parameter, view in zip(self._parameters, self._fresh_views, strict=True):
            if parameter.grad is None:
                view.zero_()
            else:
                view.copy_(parameter.grad)

    def track(self, step: int) -> None:
        """Step ``step``: the tracker update, then ``.grad`` <- y_i.

        Adapt-then-combine (default): y_i <- sum_j W_ij(t) (y_j + g_j^t - g_j^{t-1}), blocking; with k hops the
        mixing runs over W(kt), ..., W(kt + k - 1) in turn. Overlapped: y_i <- sum_j W_ij(t) y_j^{t-1} + g_i^t -
        g_i^{t-1}, waiting for the exchange :meth:`start` posted. A collective over those W's edges: every rank
        calls it once per step. When no parameter has a gradient, the step brings none (g^t = g^{t-1}) and
        ``.grad`` is left as it is.

        Args:
            step: the step's number, the same on every rank.
        """
        parameters = self._parameters
        has_gradient = any(p.grad is not None for p in parameters)
        # once a step: a call again after an interrupted wait (or a rebind) within the step does not correct twice
        correct = has_gradient and self._corrected_at != step
        with torch.no_grad():
            if correct:
                self._read_gradients()  # g^t (a missing .grad counts as 0)
            if self.overlap:
                self.start(step)  # posted already unless this step had no start (then blocking)
                self.mixing.finish(self._pending)  # a wait interrupted here is resumed by the next call
                self._pending = self._mixing_before = None
                if correct:
                    self._correct(step)
            else:
                if correct:
                    self._correct(step)
                for hop in range(0 if self._blocking is None else self._blocking[0], self.hops):
                    if self._blocking is None:
                        self._blocking = (hop, self.mixing.start(self.hops * step + hop))
                    self.mixing.finish(self._blocking[1])  # a wait interrupted here is resumed by the next call
                    self._blocking = None
            if not has_gradient:
                return
            for parameter, view in zip(parameters, self._tracker_views, strict=True):
                if parameter.grad is None:
                    parameter.grad = view.clone()
                else:
                    parameter.grad.copy_(view)

    def state_dict(self) -> dict[str, Any]:
        """Copies of the trackers y_i and of the previous gradients g_i^{t-1}, for a checkpoint.

        With an overlapped exchange in flight, the mixing's state before it started (a resumed run posts it again).

        Returns:
            ``{"trackers": [...], "previous": [...], "mixing": ...}``, one tensor per bucket each, and the state of
                the trackers' algorithm (PowerGossip's factors; empty for exact mixing).
        """
        return {
            "trackers": [tracker.buffer.detach().clone() for tracker in self.trackers],
            "previous": [previous.detach().clone() for previous in self.previous],
            "mixing": self._mixing_before if self._pending is not None else self.mixing.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: the saved trackers and previous gradients.

        Raises:
            CheckpointMismatchError: the saved buffers do not have the layout of this run's buckets.
        """
        self.drain()
        saved = [*state["trackers"], *state["previous"]]
        mine = [*(tracker.buffer for tracker in self.trackers), *self.previous]
        if [(t.shape, t.dtype) for t in saved] != [(t.shape, t.dtype) for t in mine]:
            raise CheckpointMismatchError(
                f"rank {self.mixing.comm.rank}: the saved gradient trackers do not have this run's bucket layout"
            )
        for target, value in zip(mine, saved, strict=True):
            target.copy_(value)
        self._corrected_at = -1
        self.mixing.load_state_dict(state.get("mixing", {}))
