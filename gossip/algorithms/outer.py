r"""An outer optimizer on a periodic synchronisation: local steps, then an outer step on averaged pseudo-gradients.

Every rank i holds its replica :math:`x_i` (the buckets, trained by the user's optimizer: the inner optimizer),
its own anchor :math:`\theta_i` and outer momentum :math:`v_i`. Steps t with (t + 1) % H == 0 are
synchronisations, numbered k = (t + 1) // H - 1. At synchronisation k

1. the pseudo-gradient :math:`\Delta_i = \theta_i - x_i`;
2. its average by the ``averaging`` algorithm, run on the pseudo-gradients at its own step k:
   :math:`\hat\Delta_i = \frac1n \sum_j \Delta_j` with :class:`gossip.AllReduce`;
   :math:`\hat\Delta_i = \sum_j W_{ij}(k)\, \Delta_j` with :class:`gossip.ExactGossip` (one peer per step on a
   one-peer schedule: NoLoCo, arXiv 2506.10911, Section 3); :math:`\hat\Delta_i = \Delta_i + \gamma \sum_j
   W_{ij}(k)\, P_{ij} (\Delta_j - \Delta_i)`, a rank-r projection of the differences, with
   :class:`gossip.PowerGossip` (Vogels et al. 2020, Section 3);
3. the outer step, SGD with (Nesterov) momentum :math:`\mu` and learning rate :math:`\alpha` on this rank's own
   state (:func:`outer_step`, ``torch.optim.SGD``'s update):

   .. math::  v_i \leftarrow \mu v_i + \hat\Delta_i, \qquad \theta_i \leftarrow \theta_i - \alpha\,(\hat\Delta_i
              + \mu v_i)

4. :math:`x_i \leftarrow \theta_i`.

With All-Reduce this is DiLoCo (Douillard et al. 2023, Algorithm 1; :class:`gossip.DiLoCo` is this class with
:class:`gossip.AllReduce`): every rank holds the same :math:`\theta, v`. With gossip the anchors differ between
ranks, so each rank's outer state is its own. Sum invariant: with a doubly stochastic W (and PowerGossip's equal
and opposite per-edge corrections on a symmetric one) :math:`\sum_i \hat\Delta_i = \sum_i \Delta_i`, and the outer
step is linear in :math:`\hat\Delta, v, \theta`, so the ranks' mean :math:`(\bar\theta, \bar v)` takes exactly the
outer step of the mean pseudo-gradient :math:`\bar\Delta = \bar\theta - \bar x`: gossip changes each rank's
deviation from that mean, never the mean (up to float rounding).

Between two synchronisations (``between``): nothing is sent (DiLoCo), or ``between`` -- an algorithm such as
:class:`gossip.PowerGossip` -- mixes the replicas every step (a hybrid: per-step gossip and an outer step every H).
``between`` does not run on a synchronisation step and counts its own steps, s = t - (t + 1) // H (as
:class:`gossip.PeriodicAverage`'s inner algorithm does), so a time-varying schedule cycles through all its phases.

Delayed (streaming) outer update, ``delay`` = :math:`\tau` >= 1 (Streaming DiLoCo, Douillard et al. 2025,
arXiv 2501.18512, Section 2 "overlapping communication"; torchft's ``fragment_sync_delay``): the averaging posted at
step t completes only at step t + :math:`\tau` (in that step's ``finish``, before its update), so it overlaps
the compute of :math:`\tau + 1` steps; training continues from :math:`x_i` meanwhile. Then, instead of step 4,
the replica merges its progress with the new anchor, :math:`x_i \leftarrow \theta_i + a\,(x_i - \theta_i)`
(``torch.lerp``, the paper's mixing factor, torchft's ``fragment_update_alpha``; ``merge`` a = 0 drops the
:math:`\tau` local updates, a = 1/2 is the paper's choice). :math:`\tau` < H: one synchronisation in flight.

Time line. ``start(t)`` of a synchronisation computes :math:`\Delta_i` into buffers laid out as the buckets and
starts the averaging's exchange; forward and backward run meanwhile; ``finish`` of step t + :math:`\tau` waits,
steps and writes the replica (the wrapper's one-step overlap, docs/design.md B.1). Checkpoints: :meth:`state_dict`
is the state before the current step's ``start`` (so ``start_keeps_state``): the anchors, the momenta, the parts'
states, and a synchronisation in flight since an earlier step (this rank's own :math:`\Delta_i` and the averaging's
state before it started), which a resumed run posts again at its first ``start`` -- the averaging's result depends
only on those, so the resumed run is bit-identical.

Cost per synchronisation: the averaging's bytes on the pseudo-gradients (All-Reduce: :math:`2\frac{n-1}{n} M`;
exact gossip: M per out-peer; PowerGossip: its compressed products), plus ``between``'s on the other steps. Memory:
:math:`\theta_i`, :math:`v_i` (none with :math:`\mu = 0`) and the pseudo-gradients, three copies of the parameters.

Non-finite input: the averaged pseudo-gradient is checked. With All-Reduce every rank sees the same mean and
:class:`gossip.errors.NonFiniteError` names the ranks whose replicas hold NaN or Inf, on every rank; with gossip a
peer's NaN is the averaging algorithm's to report (its ``nonfinite`` policy), and this rank raises for its own.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.base import Algorithm, all_finite_on_host
from gossip.algorithms.buckets import Bucket
from gossip.algorithms.period import EveryPeriod, PeriodStep
from gossip.backends.base import Communicator
from gossip.errors import ArgumentTypeError, CheckpointMismatchError, InvalidArgumentError, NonFiniteError
from topologies import Schedule

__all__ = ["OuterOptimizer", "outer_step"]


def outer_step(
    params: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    first: bool,
) -> None:
    r"""One step of SGD with (Nesterov) momentum on ``params`` in place.

    For every tensor, :math:`v \leftarrow \mu v + g` (:math:`v \leftarrow g` when ``first``), then
    :math:`p \leftarrow p - \text{lr} (g + \mu v)` with ``nesterov``, else :math:`p \leftarrow p - \text{lr}\, v`;
    with ``momentum == 0``, :math:`p \leftarrow p - \text{lr}\, g` (``momenta`` unused).

    The operations of ``torch.optim.SGD``'s single-tensor update (dampening 0, no weight decay), in its order, so
    the result has its bits. ``grads`` are read only.

    Args:
        params: the tensors to update in place.
        momenta: their momentum buffers, updated in place.
        grads: their gradients (here the averaged pseudo-gradients).
        lr: the learning rate.
        momentum: :math:`\mu`.
        nesterov: Nesterov momentum instead of heavy-ball.
        first: the first step, which sets :math:`v \leftarrow g`.
    """
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        step = grad
        if momentum != 0:
            buffer = momenta[index]
            if first:
                buffer.copy_(grad)
            else:
                buffer.mul_(momentum).add_(grad)
            step = grad.add(buffer, alpha=momentum) if nesterov else buffer
        param.add_(step, alpha=-lr)


@dataclass
class _Sync:
    step: int  # the training step that started it
    index: int  # k, the averaging algorithm's step
    pending: Any  # what the averaging's start returned; None for one loaded from a checkpoint, not yet posted


def _number(owner: str, name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        ok = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise InvalidArgumentError(f"{owner}: {name} must be a number in {interval}, got {value!r}")
    return float(value)


class OuterOptimizer(EveryPeriod):
    r"""Local steps, then an outer (Nesterov) SGD step on pseudo-gradients averaged by ``averaging``.

    ``OuterOptimizer(AllReduce(), local_steps=20)`` is DiLoCo; ``OuterOptimizer(ExactGossip(), 20)`` averages the
    pseudo-gradients with the schedule's peers; ``OuterOptimizer(PowerGossip(rank=4), 50, between=PowerGossip())``
    gossips compressed differences every step and takes a compressed outer step every 50; ``delay=1, merge=0.5``
    overlaps each synchronisation with the next step (Streaming DiLoCo). The math: the module docstring.

    Args:
        averaging: how the pseudo-gradients are averaged (an unbound :class:`gossip.Algorithm`: AllReduce,
            ExactGossip, PowerGossip, ...); it mixes buffers laid out as the parameter buckets.
        local_steps: H, steps between synchronisations, an integer >= 1.
        outer_lr: the outer learning rate :math:`\alpha`, positive and finite.
        outer_momentum: :math:`\mu`, in [0, 1).
        nesterov: Nesterov momentum (True) or heavy-ball (False).
        between: an algorithm mixing the replicas on the steps between synchronisations, or None (nothing sent).
        delay: :math:`\tau`, the steps a synchronisation stays in flight (0: completed in its own step), < H.
        merge: a in [0, 1], the weight of the replica's own progress when a delayed synchronisation lands.
        schedule: the schedule of the averaging, or None for the wrapper's (e.g. a one-peer schedule for the
            pseudo-gradients while ``between`` gossips on a ring).

    Raises:
        ArgumentTypeError: ``averaging`` or ``between`` is not a :class:`gossip.Algorithm`, or ``schedule`` not a
            :class:`topologies.Schedule`.
        InvalidArgumentError: a setting is out of range.
    """

    name = "outer"
    start_keeps_state = True  # state_dict is the state before the open step's start (module docstring)
    state_dict_is_snapshot = True  # copies throughout
    _label = "OuterOptimizer"

    def __init__(
        self,
        averaging: Algorithm,
        local_steps: int = 20,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        *,
        between: Algorithm | None = None,
        delay: int = 0,
        merge: float = 0.0,
        schedule: Schedule | None = None,
    ):
        label = self._label
        if not isinstance(averaging, Algorithm):
            raise ArgumentTypeError(f"{label}: averaging must be a gossip.Algorithm, got {type(averaging).__name__}")
        if between is not None and not isinstance(between, Algorithm):
            raise ArgumentTypeError(f"{label}: between must be a gossip.Algorithm or None, got {between!r}")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ArgumentTypeError(f"{label}: schedule must be a topologies.Schedule or None, got {schedule!r}")
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise InvalidArgumentError(
                f"{label}: local_steps must be an integer >= 1 (steps between synchronisations), got {local_steps!r}"
            )
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < math.inf:
            raise InvalidArgumentError(f"{label}: outer_lr must be a positive finite number, got {outer_lr!r}")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)):
            raise InvalidArgumentError(f"{label}: outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
        if not 0 <= outer_momentum < 1:
            raise InvalidArgumentError(f"{label}: outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if not isinstance(nesterov, bool):
            raise InvalidArgumentError(f"{label}: nesterov must be True or False, got {nesterov!r}")
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < local_steps:
            raise InvalidArgumentError(
                f"{label}: delay must be an integer in [0, local_steps) = [0, {local_steps}) (one synchronisation "
                f"in flight at a time), got {delay!r}"
            )
        self.merge = _number(label, "merge", merge, 0.0, 1.0, low_open=False, high_open=False)
        self.averaging, self.between, self.sync_schedule = averaging, between, schedule
        self.local_steps, self.delay = local_steps, delay
        self._period_length = local_steps
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), nesterov
        self._sync: list[torch.Tensor] = []  # theta_i, one tensor per bucket
        self._momentum: list[torch.Tensor] = []  # v_i (none with outer_momentum 0)
        self._deltas: list[Bucket] = []  # the pseudo-gradients, laid out as the buckets
        self._outer_steps = 0
        self._inflight: _Sync | None = None
        self._averaging_before: dict[str, Any] | None = None  # the averaging's state before the in-flight start
        self._between_before: dict[str, Any] | None = None  # between's state before the open step's start
        self._open: int | None = None  # the step whose start ran and whose finish has not
        self._loaded = False

    @property
    def needs_symmetric_schedule(self) -> bool:  # type: ignore[override]
        """Whether a part needs a symmetric schedule (PowerGossip does)."""
        return bool(self.between is not None and self.between.needs_symmetric_schedule) or (
            self.sync_schedule is None and self.averaging.needs_symmetric_schedule
        )

    @property
    def nonfinite(self) -> str:  # type: ignore[override]
        """The policy for a peer's NaN or Inf: ``between``'s if any, else the averaging's."""
        return (self.between or self.averaging).nonfinite

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        """Bind; theta <- rank 0's parameters (a broadcast); bind the parts (pseudo-gradients, and the buckets).

        Args:
            comm: this rank's communicator.
            schedule: the wrapper's schedule (``between``'s, and the averaging's unless it has its own); None
                only when no part needs one.
            buckets: the parameter buckets.
        """
        super().setup(comm, schedule, buckets)
        level = schedule
        if self.sync_schedule is not None:
            level = self.sync_schedule
            level.require_size(comm.size)
            level.validate(symmetric=self.averaging.needs_symmetric_schedule)
        with torch.no_grad():
            self._sync = [bucket.buffer.detach().clone() for bucket in buckets]
            for sync in self._sync:
                comm.broadcast(sync, 0)
            self._momentum = [torch.zeros_like(sync) for sync in self._sync] if self.outer_momentum else []
            self._deltas = [Bucket(torch.zeros_like(bucket.buffer), bucket.entries) for bucket in buckets]
        self.setup_part(self.averaging, level, self._deltas)
        if self.between is not None:
            self.setup_part(self.between, schedule, buckets)
        self._outer_steps, self._inflight, self._open = 0, None, None

    @property
    def outer_steps(self) -> int:
        """The outer steps taken so far."""
        return self._outer_steps

    def synchronised(self) -> list[torch.Tensor]:
        """Theta_i, one tensor per bucket (laid out as the bucket). Read only.

        Returns:
            One tensor per bucket.
        """
        return list(self._sync)

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """The pseudo-gradient buffers, one tensor per bucket. Read only.

        They hold this rank's Delta_i while a synchronisation is in flight, its average after it landed.

        Returns:
            One tensor per bucket.
        """
        return [delta.buffer for delta in self._deltas]

    # -- the period end (the step loop: gossip.algorithms.period.EveryPeriod) ----------------------------------
    def _parts(self) -> list[Algorithm]:
        """The averaging and ``between``: their deferred non-finite checks run here."""
        return [part for part in (self.averaging, self.between) if part is not None]

    def _before_start(self, step: int) -> None:
        if self._loaded:
            self._check_agreement(step)
        if self._inflight is not None and self._inflight.pending is None:  # loaded: post its averaging again
            self._inflight.pending = self.averaging.start(self._inflight.index)

    def _start_period_end(self, step: int) -> None:
        with torch.no_grad():
            for delta, sync, bucket in zip(self._deltas, self._sync, self.buckets, strict=True):
                torch.sub(sync, bucket.buffer, out=delta.buffer)
        index = self.period.index(step)
        self._averaging_before = self.averaging.state_snapshot()
        self._inflight = _Sync(step, index, self.averaging.start(index))

    def _finish_step_end(self, pending: PeriodStep) -> None:
        inflight = self._inflight
        if inflight is not None and inflight.step + self.delay == pending.step:
            self._land(inflight, pending.step)

    def _land(self, inflight: _Sync, step: int) -> None:
        """Complete the averaging, take the outer step and write the replica (or merge it, when delayed)."""
        self.averaging.finish(inflight.pending)
        self._inflight, self._averaging_before = None, None
        deltas = self.pseudo_gradients()
        if not all_finite_on_host(deltas):
            self._refuse_nonfinite_mean(step)
        with torch.no_grad():
            outer_step(
                self._sync,
                self._momentum,
                deltas,
                lr=self.outer_lr,
                momentum=self.outer_momentum,
                nesterov=self.nesterov,
                first=self._outer_steps == 0,
            )
            for bucket, sync in zip(self.buckets, self._sync, strict=True):
                if self.delay and self.merge:
                    bucket.buffer.copy_(torch.lerp(sync, bucket.buffer, self.merge))
                else:
                    bucket.buffer.copy_(sync)
        self._outer_steps += 1

    def drain(self) -> None:
        """Complete a synchronisation still in flight and drop it (for ``close()``; every rank calls it)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None and inflight.pending is not None:
            self.averaging.finish(inflight.pending)
        self._averaging_before = None

    def _refuse_nonfinite_mean(self, step: int) -> None:
        """The averaged pseudo-gradient holds NaN or Inf. All-Reduce: every rank sees it, so every rank gathers
        and names the ranks whose replicas do. Gossip: this rank's (a peer's was the averaging's to report)."""
        where = f"rank {self.comm.rank}: step {step}: {self._label}'s"
        finite = all_finite_on_host([bucket.buffer for bucket in self.buckets])
        if not isinstance(self.averaging, AllReduce):
            whose = "this rank's replica holds NaN or Inf" if not finite else "a peer's replica holds NaN or Inf"
            raise NonFiniteError(
                f"{where} averaged pseudo-gradient is non-finite: {whose}; training has diverged (lower the "
                "learning rate or the local steps)"
            )
        bad = [rank for rank, ok in enumerate(self.comm.all_gather_object(finite)) if not ok]
        if not bad:
            raise NonFiniteError(
                f"{where} mean pseudo-gradient is non-finite: every replica is finite but the sum overflows; "
                "training has diverged (lower the learning rate)"
            )
        raise NonFiniteError(
            f"{where} mean pseudo-gradient is non-finite: the replicas of ranks {bad} hold NaN or Inf; they diverged "
            "during the local steps (lower the learning rate or --local-steps)"
        )

    def _check_agreement(self, step: int) -> None:
        """After a load, with All-Reduce (every rank holds the same theta and v): compare them across ranks, with
        one all_gather_object of a SHA-256, once."""
        self._loaded = False
        if not isinstance(self.averaging, AllReduce):
            return  # with gossip the anchors differ between ranks by design
        digest = hashlib.sha256(str(self._outer_steps).encode())
        for tensor in [*self._sync, *self._momentum]:
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests = self.comm.all_gather_object(digest.hexdigest())
        other = next((rank for rank, d in enumerate(digests) if d != digests[0]), None)
        if other is not None:
            raise CheckpointMismatchError(
                f"rank {self.comm.rank}: step {step}: rank {other}'s {self._label} state (synchronised parameters, "
                "outer momentum, outer step count) differs from rank 0's after loading it; every rank must load the "
                "state saved by the same save (one checkpoint's files on every rank)"
            )

    # -- state ----------------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The settings every rank must share, the parts' names and configs included.

        Returns:
            Setting name -> value.
        """
        between = self.between
        return {
            "local_steps": self.local_steps,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
            "delay": self.delay,
            "merge": self.merge,
            "averaging": {"name": self.averaging.name, **self.averaging.config()},
            "between": None if between is None else {"name": between.name, **between.config()},
            "schedule": None if self.sync_schedule is None else self.sync_schedule.fingerprint(),
        }

    def state_dict(self) -> dict[str, Any]:
        """The state before the open step's ``start`` (copies), for a checkpoint.

        Theta, v, the outer step count, the parts' states and a synchronisation in flight since an earlier step
        (its step and this rank's pseudo-gradients).

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        inflight = self._inflight
        saved = inflight is not None and (self._open is None or inflight.step < self._open)
        between = self._between_state()
        averaging = self._averaging_before if inflight is not None else self.averaging.state_dict()
        return {
            "config": self.config(),
            "outer_steps": self._outer_steps,
            "sync": [sync.detach().clone() for sync in self._sync],
            "momentum": [buffer.detach().clone() for buffer in self._momentum],
            "averaging": copy.deepcopy(averaging),
            "between": copy.deepcopy(between),
            "inflight": None
            if not saved
            else {"step": inflight.step, "deltas": [t.detach().clone() for t in self.pseudo_gradients()]},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned.

        A synchronisation in flight here is completed and dropped first; a saved synchronisation in flight is
        posted again at the next ``start``.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: the state was saved with another config, or its tensors do not fit this run's
                buckets.
        """
        where = f"rank {self.comm.rank}" if getattr(self, "comm", None) is not None else self._label
        if state.get("config") != self.config():
            raise InvalidArgumentError(
                f"{where}: {self._label} state was saved with {state.get('config')}, this run uses {self.config()}"
            )
        inflight = state.get("inflight")
        keys = [("sync", self._sync), ("momentum", self._momentum)]
        if inflight is not None:
            keys.append(("deltas", self.pseudo_gradients()))
        for key, mine in keys:
            saved = (inflight or {}).get(key) if key == "deltas" else state[key]
            layout = [(tuple(t.shape), t.dtype) for t in saved]
            if layout != [(tuple(t.shape), t.dtype) for t in mine]:
                raise InvalidArgumentError(
                    f"{where}: {self._label} state '{key}' holds tensors {layout}, this run's buckets need "
                    f"{[(tuple(t.shape), t.dtype) for t in mine]} (another model or bucket_bytes)"
                )
        self.drain()
        with torch.no_grad():
            for mine, saved in zip([*self._sync, *self._momentum], [*state["sync"], *state["momentum"]], strict=True):
                mine.copy_(saved)
            if inflight is not None:
                for mine, saved in zip(self.pseudo_gradients(), inflight["deltas"], strict=True):
                    mine.copy_(saved)
        if state.get("averaging") is not None:
            self.averaging.load_state_dict(copy.deepcopy(state["averaging"]))
        if self.between is not None and state.get("between") is not None:
            self.between.load_state_dict(copy.deepcopy(state["between"]))
        if inflight is not None:
            step = int(inflight["step"])
            self._inflight = _Sync(step, self.period.index(step), None)
            self._averaging_before = copy.deepcopy(state["averaging"])
        self._outer_steps = int(state["outer_steps"])
        self._open, self._between_before = None, None
        self._loaded = True
