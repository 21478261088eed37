r"""DiLoCo: H local steps, then an all-reduce of the pseudo-gradient and an outer Nesterov-SGD step.

Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen, "DiLoCo: Distributed Low-Communication
Training of Language Models" (arXiv 2311.08105, 2023), Algorithm 1. Every worker holds the synchronised
parameters :math:`\theta` (the same on every rank) and its own replica :math:`x_i`. It trains :math:`x_i` alone
(the inner optimizer, AdamW in the paper: the user's optimizer here) and, every H steps,

1. takes its pseudo-gradient :math:`\Delta_i = \theta - x_i` (the old global parameters minus the new local ones);
2. averages it over the n workers by an all-reduce, :math:`\Delta = \frac1n \sum_i \Delta_i`;
3. applies the outer optimizer to :math:`\theta` with :math:`\Delta` as its gradient -- SGD with Nesterov momentum
   :math:`\mu` and learning rate :math:`\alpha` (0.9 and 0.7 in the paper and its reproductions):

   .. math::  v \leftarrow \mu v + \Delta, \qquad \theta \leftarrow \theta - \alpha\,(\Delta + \mu v)

   (``nesterov=False``: :math:`\theta \leftarrow \theta - \alpha v`; :math:`\mu = 0`: :math:`\theta \leftarrow
   \theta - \alpha \Delta`, no buffer);
4. sets :math:`x_i \leftarrow \theta`.

Nothing is communicated between two synchronisations. With :math:`\alpha = 1, \mu = 0` step 3 is
:math:`\theta \leftarrow \bar x`, the exact average (local SGD / :class:`gossip.PeriodicAverage`).

The update of step 3 is :func:`outer_step`: ``torch.optim.SGD(momentum=mu, nesterov=True)``'s single-tensor update
(dampening 0, no weight decay), its operations in the same order, so it gives torch's bits on the same inputs
(the tests compare it with torch's SGD, with the formula above in float64 and with ``torchft.local_sgd.DiLoCo``).
Like torch, the first outer step sets :math:`v \leftarrow \Delta`.

Time line. The synchronisation steps are those t with (t + 1) % H == 0, as :class:`gossip.PeriodicAverage`'s
averaging steps. ``start(t)`` of such a step reads :math:`x_t` (the parameters after step t - 1's update: the
wrapper starts step t's exchange right after it), computes :math:`\Delta_i` into a new buffer per bucket and posts
one non-blocking all-reduce (mean) of each; forward and backward of step t run meanwhile. ``finish`` (at step t's
``optimizer.step()``, before the update) waits, applies the outer step and writes :math:`\theta` into the
buckets; step t's update is then applied to :math:`\theta`. So the pseudo-gradient of every synchronisation but
the first spans H local updates (steps t - H ... t - 1); the first spans H - 1 (steps 0 ... H - 2, from the
parameters at construction). Step t's gradient is taken at :math:`x_t`, before the outer step: the one-step
overlap of every algorithm of the wrapper (docs/design.md B.1, G). Other steps do nothing and send nothing.

Invariant: every rank holds the same :math:`\theta` and :math:`v`, bit for bit. :meth:`DiLoCo.setup` broadcasts
rank 0's parameters into :math:`\theta` (as the wrapper broadcasts them into the replicas), and every outer step
applies the same all-reduced :math:`\Delta` (the same bits on every rank: the communicators' all-reduce) to the
same :math:`\theta, v` by the same operations. After a synchronisation every replica is :math:`\theta`. A state
loaded with :meth:`DiLoCo.load_state_dict` (checkpoint resume) is compared across ranks at the next ``start`` (one
``all_gather_object`` of a SHA-256 of it), so files from different ranks' histories are refused there.

Cost: per synchronisation a ring all-reduce of the model, :math:`2\frac{n-1}{n} M` bytes per rank for M bytes of
parameters (booked as :class:`gossip.AllReduce` books it), :math:`2\frac{n-1}{nH} M` per step on average: 1/H of a
gradient all-reduce's (DDP's) bytes. Memory: :math:`\theta` and :math:`v` (two copies of the parameters on their
device; no :math:`v` with :math:`\mu = 0`), plus the pseudo-gradients while a synchronisation is in flight.

Non-finite input: the mean pseudo-gradient is checked (one ``isfinite(...).all()`` per bucket); if it holds NaN or
Inf, :class:`gossip.errors.NonFiniteError` names the ranks whose replicas hold NaN or Inf (there is no "drop":
an outer step without some workers' progress is not DiLoCo's).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import Bucket
from gossip.backends.base import Communicator
from gossip.backends.comm_thread import Handle
from gossip.errors import CheckpointMismatchError, InvalidArgumentError, NonFiniteError
from topologies import Schedule

__all__ = ["LOCAL_STEPS", "OUTER_LR", "OUTER_MOMENTUM", "DiLoCo", "outer_step"]

#: The defaults: H = 20 local steps between synchronisations (1/20 of DDP's bytes, the project's byte budget, and
#: 25 outer steps in the main job's 500), and the outer Nesterov SGD of the paper and its reproductions
#: (OpenDiLoCo, torchft's examples): lr 0.7, momentum 0.9.
LOCAL_STEPS = 20
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


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
        grads: their gradients (here the mean pseudo-gradients).
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
    step: int
    deltas: list[torch.Tensor]  # this rank's pseudo-gradients, then (after the wait) their mean over ranks
    handles: list[Handle]


class DiLoCo(Algorithm):
    r"""DiLoCo (module docstring): ``local_steps`` local steps, then the mean pseudo-gradient's outer step.

    ``DiLoCo(local_steps=20, outer_lr=0.7, outer_momentum=0.9)`` synchronises on steps 19, 39, ... with Nesterov
    SGD as the outer optimizer (``nesterov=False``: heavy-ball momentum). Needs no schedule: the synchronisation is
    an all-reduce over all ranks.

    Args:
        local_steps: H, steps between synchronisations, an integer >= 1.
        outer_lr: the outer learning rate, positive and finite.
        outer_momentum: :math:`\mu` of the outer optimizer, in [0, 1).
        nesterov: Nesterov momentum (True) or heavy-ball (False).

    Raises:
        InvalidArgumentError: a setting is out of range or of the wrong kind.
    """

    name = "diloco"
    start_keeps_state = True  # start only reads theta; finish's outer step is the one change

    def __init__(
        self,
        local_steps: int = LOCAL_STEPS,
        outer_lr: float = OUTER_LR,
        outer_momentum: float = OUTER_MOMENTUM,
        nesterov: bool = True,
    ):
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise InvalidArgumentError(
                f"DiLoCo: local_steps must be an integer >= 1 (steps between synchronisations), got {local_steps!r}"
            )
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < math.inf:
            raise InvalidArgumentError(f"DiLoCo: outer_lr must be a positive finite number, got {outer_lr!r}")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)):
            raise InvalidArgumentError(f"DiLoCo: outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
        if not 0 <= outer_momentum < 1:
            raise InvalidArgumentError(f"DiLoCo: outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if not isinstance(nesterov, bool):
            raise InvalidArgumentError(f"DiLoCo: nesterov must be True or False, got {nesterov!r}")
        self.local_steps = local_steps
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = nesterov
        self._sync: list[torch.Tensor] = []  # theta, one tensor per bucket
        self._momentum: list[torch.Tensor] = []  # v, one per bucket (none with outer_momentum 0)
        self._outer_steps = 0
        self._loaded = False  # a state was loaded: compare it across ranks at the next start

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        """Bind, and set theta to rank 0's parameters (a broadcast: every rank starts from the same theta).

        Args:
            comm: this rank's communicator.
            schedule: ignored (the synchronisation is an all-reduce); may be None.
            buckets: the parameter buckets.
        """
        super().setup(comm, schedule, buckets)
        with torch.no_grad():
            self._sync = [bucket.buffer.detach().clone() for bucket in buckets]
            for sync in self._sync:
                comm.broadcast(sync, 0)
            self._momentum = [torch.zeros_like(sync) for sync in self._sync] if self.outer_momentum else []
        self._outer_steps = 0

    def syncs(self, step: int) -> bool:
        """Whether ``step`` is a synchronisation step: (step + 1) % local_steps == 0.

        Args:
            step: a training step.

        Returns:
            True on a synchronisation step.
        """
        return (step + 1) % self.local_steps == 0

    @property
    def outer_steps(self) -> int:
        """The outer steps taken so far."""
        return self._outer_steps

    def synchronised(self) -> list[torch.Tensor]:
        """Theta, one tensor per bucket (laid out as the bucket): what every replica holds after a synchronisation.

        Read only; the same bits on every rank.

        Returns:
            One tensor per bucket.
        """
        return list(self._sync)

    # -- the Algorithm interface ----------------------------------------------------------------------------
    def _start_step(self, step: int) -> _Sync | None:
        if self._loaded:
            self._check_agreement(step)
        if not self.syncs(step):
            return None
        with torch.no_grad():
            deltas = [torch.sub(sync, bucket.buffer) for sync, bucket in zip(self._sync, self.buckets, strict=True)]
        return _Sync(step, deltas, [self._all_reduce(delta) for delta in deltas])

    def _finish_step(self, pending: _Sync | None) -> None:
        if pending is None:
            return
        for handle in pending.handles:
            self._wait(handle)
        checks = [torch.isfinite(delta).all() for delta in pending.deltas if delta.numel()]
        if checks and not bool(torch.stack(checks).all()):
            self._refuse_nonfinite_mean(pending.step)
        with torch.no_grad():
            outer_step(
                self._sync,
                self._momentum,
                pending.deltas,
                lr=self.outer_lr,
                momentum=self.outer_momentum,
                nesterov=self.nesterov,
                first=self._outer_steps == 0,
            )
            for bucket, sync in zip(self.buckets, self._sync, strict=True):
                bucket.buffer.copy_(sync)
        self._outer_steps += 1

    def _refuse_nonfinite_mean(self, step: int) -> None:
        """The mean pseudo-gradient holds NaN or Inf: name the ranks whose replicas do (every rank sees the same
        mean, so every rank gathers and raises)."""
        finite = all(bool(torch.isfinite(bucket.buffer).all()) for bucket in self.buckets)
        bad = [rank for rank, ok in enumerate(self.comm.all_gather_object(finite)) if not ok]
        where = f"rank {self.comm.rank}: step {step}: DiLoCo's mean pseudo-gradient is non-finite"
        if not bad:
            raise NonFiniteError(
                f"{where}: every replica is finite but the sum overflows; training has diverged (lower the "
                "learning rate)"
            )
        raise NonFiniteError(
            f"{where}: the replicas of ranks {bad} hold NaN or Inf; they diverged during the local steps (lower the "
            "learning rate or --local-steps)"
        )

    def _check_agreement(self, step: int) -> None:
        """After a load: every rank must hold the same theta, v and outer step count (else the ranks would
        synchronise to different models). One all_gather_object of a SHA-256, once."""
        self._loaded = False
        digest = hashlib.sha256(str(self._outer_steps).encode())
        for tensor in [*self._sync, *self._momentum]:
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests = self.comm.all_gather_object(digest.hexdigest())
        other = next((rank for rank, d in enumerate(digests) if d != digests[0]), None)
        if other is not None:
            raise CheckpointMismatchError(
                f"rank {self.comm.rank}: step {step}: rank {other}'s DiLoCo state (synchronised parameters, outer "
                "momentum, outer step count) differs from rank 0's after loading it; every rank must load the state "
                "saved by the same save (one checkpoint's files on every rank)"
            )

    # -- state ----------------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The settings every rank must share: ``local_steps``, ``outer_lr``, ``outer_momentum``, ``nesterov``.

        Returns:
            Setting name -> value.
        """
        return {
            "local_steps": self.local_steps,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
        }

    def state_dict(self) -> dict[str, Any]:
        """Theta, the outer momentum and the outer step count (copies), with the config they belong to.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        return {
            "config": self.config(),
            "outer_steps": self._outer_steps,
            "sync": [sync.detach().clone() for sync in self._sync],
            "momentum": [buffer.detach().clone() for buffer in self._momentum],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned; the ranks compare it at the next ``start``.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: the state was saved with another config, or its tensors do not fit this run's
                buckets.
        """
        where = f"rank {self.comm.rank}" if getattr(self, "comm", None) is not None else "DiLoCo"
        if state.get("config") != self.config():
            raise InvalidArgumentError(
                f"{where}: DiLoCo state was saved with {state.get('config')}, this run uses {self.config()}"
            )
        for key, mine in (("sync", self._sync), ("momentum", self._momentum)):
            saved = state[key]
            layout = [(tuple(t.shape), t.dtype) for t in saved]
            if layout != [(tuple(t.shape), t.dtype) for t in mine]:
                raise InvalidArgumentError(
                    f"{where}: DiLoCo state '{key}' holds tensors {layout}, this run's buckets need "
                    f"{[(tuple(t.shape), t.dtype) for t in mine]} (another model or bucket_bytes)"
                )
        with torch.no_grad():
            for mine, saved in zip([*self._sync, *self._momentum], [*state["sync"], *state["momentum"]], strict=True):
                mine.copy_(saved)
        self._outer_steps = int(state["outer_steps"])
        self._loaded = True
