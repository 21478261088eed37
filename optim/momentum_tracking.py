r"""MomentumTrackingAdamW: AdamW whose first moment the wrapper's gradient tracker averages over the ranks.

Momentum tracking (Takezawa, Bao, Niwa, Sato & Yamada, "Momentum Tracking: Momentum Acceleration for Decentralized
Deep Learning on Heterogeneous Data", TMLR 2023) tracks each rank's first moment instead of its gradient. Per step t
on rank i, with :math:`g_i` the rank's gradient, in three phases:

1. :meth:`MomentumTrackingAdamW.prepare_momentum` (``DecentralizedDataParallel`` calls it inside
   ``optimizer.step()``, after the parameters' mixing, before the tracker):

   .. math::  h_i \leftarrow \beta_1 h_i + (1-\beta_1)\, g_i, \qquad v_i \leftarrow \beta_2 v_i + (1-\beta_2)\, g_i^2,
              \qquad \texttt{.grad} \leftarrow h_i

2. the wrapper's gradient tracker (``gradient_tracking=True``) replaces ``.grad`` by
   :math:`z_i = \sum_j W_{ij}(t)\,(z_j + h_j^t - h_j^{t-1})`, whose mean over the ranks is the mean first moment at
   every step -- DDP's, the EMA being linear (``gossip/wrapper/tracking.py`` has the induction). The tracker's
   increments are :math:`(1-\beta_1)(g_i - h_i^{t-1})`, a tenth of the gradient's noise at :math:`\beta_1 = 0.9`,
   where gradient tracking's :math:`g_i^t - g_i^{t-1}` carry twice its variance.

3. the update, with :math:`\hat z = z_i / (1-\beta_1^t)` and decoupled weight decay :math:`\lambda`:

   .. math::  x \leftarrow x\,(1 - \mathrm{lr}\,\lambda) - \mathrm{lr}\,
              \frac{\hat z}{\sqrt{\max(\hat v, \hat z^2)} + \epsilon}

The second moment :math:`\hat v` (``second_moment``):

* ``"tracker"``: the **mean gradient's**, read off the tracker every step, without a message of its own. The
  tracker's mean over the ranks is the mean first moment :math:`\bar m^t = \beta_1 \bar m^{t-1} + (1-\beta_1)\,
  \bar g^t`, so each rank inverts that recursion on its own tracker,

  .. math::  r_i = \frac{z_i^t - \beta_1 z_i^{t-1}}{1-\beta_1}, \qquad
             u_i \leftarrow \beta_2 u_i + (1-\beta_2)\, r_i^2, \qquad \hat v = \frac{u_i}{1-\beta_2^t}

  (:math:`z_i^0 = 0`). Where the trackers agree, :math:`r_i = \bar g^t` and :math:`\hat v` is DDP's AdamW second
  moment, every step's mean gradient included; where they disagree, :math:`r_i` carries the change in the
  tracker's error, which enlarges :math:`\hat v`, shortening the step, never lengthening it. Without the wrapper's
  tracking (:math:`z_i = h_i`), :math:`r_i = g_i` and :math:`\hat v` is the rank's own, AdamW's.
* ``"sample"``, ``second_moment_every`` = K > 0: on every K-th step, counted from the first (t = 0, K, 2K, ...), the
  wrapper averages the ranks' gradients (by gossip or an all-reduce, ``gossip/wrapper/mean_gradient.py``) and hands
  their mean :math:`\bar g` to :meth:`~MomentumTrackingAdamW.take_mean_gradient`, which advances
  :math:`u \leftarrow \beta_2^K u + (1-\beta_2^K)\, \bar g^2` (the same time constant in steps as :math:`v_i`);
  then

  .. math::  \hat v = \max\Big(\frac{u}{1-\beta_2^{K s}},\; \frac{v_i}{n\,(1-\beta_2^t)}\Big)

  after s samples over n ranks (the rank's own before the first sample), where
  :math:`v_i \leftarrow \beta_2 v_i + (1-\beta_2)\, g_i^2`. With K = 0 it is the rank's own,
  :math:`v_i / (1-\beta_2^t)`.

Why the mean gradient's: every rank then divides the mean first moment by the mean gradient's second moment, DDP's
step, where each rank's own :math:`E[g_i^2] = g^2 + \sigma^2` exceeds DDP's :math:`g^2 + \sigma^2/n` in the noisy
coordinates; momentum tracking with each rank's own second moment shrinks those steps below per-worker AdamW's, and
a shared second moment on each rank's own first moment lets the replicas drift apart
(experiments/learning_per_step/README.md, "Momentum tracking with the mean gradient's second moment"). Why every
step's: Adam's :math:`\hat v` holds the current gradient's square, which bounds the step a sudden gradient makes; a
sample taken every K steps misses the steps between (experiments/scale/README.md, "The second moment from the
tracker").

Why the floors. A tracker carries the other ranks' first moments into coordinates this rank's batches never touch
(embedding rows), where :math:`v_i \approx 0`; :math:`\max(\cdot, \hat z^2)` keeps every coordinate's step within
lr. With samples, a coordinate whose mean gradient is 0 at the last sample would be divided by ~0 until the next
one; the floor :math:`v_i/n` is the mean gradient's second moment where the ranks' gradients are independent noise.
The tracker's :math:`\hat v` sees every step, so it needs only the first floor.

Without the wrapper (or without its gradient tracking), :math:`z_i = h_i`, and with ``"tracker"`` or
``second_moment_every = 0`` the update is AdamW's (up to rounding) wherever AdamW's :math:`\hat m^2 \le \hat v`
(elsewhere the floor shortens the step to lr).
:meth:`~MomentumTrackingAdamW.step` runs :meth:`~MomentumTrackingAdamW.prepare_momentum` itself when nothing
called it in this step. Nothing here communicates: the tracker and the samples come from the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from numbers import Integral
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optim.hyperparameters import validate_adam_hyperparameters

__all__ = ["SECOND_MOMENTS", "MomentumTrackingAdamW", "sampling_every"]

#: The values of ``second_moment``: where the mean gradient's second moment comes from (module docstring).
SECOND_MOMENTS = ("tracker", "sample")


def sampling_every(second_moment: str, second_moment_every: int) -> int:
    """The ``second_moment_every`` that :class:`MomentumTrackingAdamW` takes for a configured pair.

    Args:
        second_moment: one of :data:`SECOND_MOMENTS`.
        second_moment_every: the configured steps between two samples.

    Returns:
        ``second_moment_every`` with ``"sample"``, else 0 (the tracker's second moment takes no samples).

    Raises:
        ValueError: ``second_moment`` is not one of :data:`SECOND_MOMENTS`.
    """
    if second_moment not in SECOND_MOMENTS:
        raise ValueError(f"second_moment must be one of {SECOND_MOMENTS}, got {second_moment!r}")
    return second_moment_every if second_moment == "sample" else 0


class MomentumTrackingAdamW(Optimizer):
    """AdamW for momentum tracking: the first moment travels through the wrapper's tracker (module docstring).

    Use it with ``DecentralizedDataParallel(..., gradient_tracking=True)`` (a wrapper without tracking refuses it at
    the first step): the wrapper then calls :meth:`prepare_momentum` before its tracker and, with
    ``second_moment="sample"``, on the steps :meth:`mean_gradient_due` names, averages the gradients for
    :meth:`take_mean_gradient` (by gossip or an all-reduce). The state (``h``, ``u``; ``v`` and the sample count with
    samples, the last tracker with ``"tracker"``) and the step count are part of :meth:`state_dict`.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: (beta1, beta2), the first and second moments' EMA rates.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (AdamW's).
        second_moment_every: with ``"sample"``, steps between two samples of the mean gradient's second moment (the
            same on every rank), 0 keeping each rank's own; None: 32. With ``"tracker"`` it must be None or 0.
        second_moment: ``"tracker"`` (the mean gradient's second moment from the tracker, every step) or
            ``"sample"`` (from samples of the mean gradient); module docstring.
        foreach: run each phase with the ``torch._foreach_*`` kernels, a few launches per parameter group instead of
            several per tensor (bit-identical to the per-tensor loop on CPU); ``None`` picks them when every
            parameter of the group is on CUDA.

    Raises:
        ValueError: a hyper-parameter is out of range (named in the message).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        second_moment_every: int | None = None,
        *,
        second_moment: str = "sample",
        foreach: bool | None = None,
    ) -> None:
        if second_moment not in SECOND_MOMENTS:
            raise ValueError(
                f"MomentumTrackingAdamW: second_moment must be one of {SECOND_MOMENTS}, got {second_moment!r}"
            )
        every = second_moment_every
        if every is None:
            every = 32 if second_moment == "sample" else 0
        if not isinstance(every, Integral) or isinstance(every, bool) or every < 0:
            raise ValueError(f"MomentumTrackingAdamW: second_moment_every must be an integer >= 0, got {every!r}")
        if second_moment == "tracker" and every:
            raise ValueError(
                f"MomentumTrackingAdamW: second_moment='tracker' takes no samples, got second_moment_every={every}; "
                "pass second_moment='sample' to sample, or leave second_moment_every out"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        validate_adam_hyperparameters(defaults, "MomentumTrackingAdamW arguments")
        # the step count and the number of ranks of the last sample live in the groups, so state_dict saves them
        super().__init__(params, {**defaults, "tracking_step": 0, "workers": 1, "foreach": foreach})
        for index, group in enumerate(self.param_groups):
            validate_adam_hyperparameters(group, f"MomentumTrackingAdamW param group {index}")
        self.second_moment_every = int(every)
        self.second_moment_source = second_moment
        self._prepared = False  # prepare_momentum ran in this step

    @property
    def tracks_second_moment(self) -> bool:
        """Whether the second moment comes from the tracker (``second_moment="tracker"``)."""
        return self.second_moment_source == "tracker"

    def _state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"], state["samples"] = 0, 0
            # "shared" is u; "v" (the rank's own) serves the samples, "last" (z_i^{t-1}) the tracker's
            second = "last" if self.tracks_second_moment else "v"
            state["h"], state[second], state["shared"] = (torch.zeros_like(p) for _ in range(3))
        return state

    def _with_gradients(self) -> Iterator[tuple[dict[str, Any], list[Tensor], list[dict[str, Any]], bool]]:
        """Per param group that has gradients: the group, its parameters with a gradient, their states, and whether
        to use the ``torch._foreach_*`` kernels on them."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                foreach = group.get("foreach")
                foreach = all(p.is_cuda for p in params) if foreach is None else foreach
                yield group, params, [self._state(p) for p in params], foreach

    def mean_gradient_due(self) -> bool:
        """Whether this step samples the mean gradient (call before :meth:`prepare_momentum`).

        Returns:
            True on steps 0, K, 2K, ... with K = ``second_moment_every`` > 0.
        """
        every = self.second_moment_every
        return every > 0 and self.param_groups[0]["tracking_step"] % every == 0

    @torch.no_grad()
    def take_mean_gradient(self, means: Mapping[Tensor, Tensor], workers: int) -> None:
        """Advance the mean gradient's second moment u with one sample.

        Args:
            means: the mean over the ranks of each parameter's gradient, keyed by the parameter (a parameter left
                out is not sampled).
            workers: n, the number of ranks the mean is over (the floor divides by it).

        Raises:
            ValueError: ``second_moment_every`` is 0, or ``workers`` < 1.
        """
        if not self.second_moment_every:
            raise ValueError(
                "MomentumTrackingAdamW: take_mean_gradient without samples (second_moment_every=0 or "
                "second_moment='tracker')"
            )
        if workers < 1:
            raise ValueError(f"MomentumTrackingAdamW: workers must be >= 1, got {workers}")
        for group in self.param_groups:
            group["workers"] = int(workers)
            rate = group["betas"][1] ** self.second_moment_every
            for p in group["params"]:
                if p in means:
                    state = self._state(p)
                    state["shared"].mul_(rate).addcmul_(means[p], means[p], value=1 - rate)
                    state["samples"] += 1

    @torch.no_grad()
    def prepare_momentum(self) -> None:
        """Advance h_i (and v_i, with samples) with each parameter's gradient and write h_i into ``.grad`` (phase 1)."""
        for group, params, states, foreach in self._with_gradients():
            beta1, beta2 = group["betas"]
            for state in states:
                state["step"] += 1
            grads, h = [p.grad for p in params], [st["h"] for st in states]
            if self.tracks_second_moment:
                if foreach:
                    torch._foreach_lerp_(h, grads, 1 - beta1)
                    torch._foreach_copy_(grads, h)
                    continue
                for g, h_i in zip(grads, h, strict=True):
                    h_i.lerp_(g, 1 - beta1)
                    g.copy_(h_i)
                continue
            v = [st["v"] for st in states]
            if foreach:
                torch._foreach_mul_(v, beta2)
                torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
                torch._foreach_lerp_(h, grads, 1 - beta1)
                torch._foreach_copy_(grads, h)
                continue
            for g, v_i, h_i in zip(grads, v, h, strict=True):
                v_i.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                h_i.lerp_(g, 1 - beta1)
                g.copy_(h_i)
        for group in self.param_groups:
            group["tracking_step"] += 1
        self._prepared = True

    def second_moment(self, group: dict[str, Any], state: dict[str, Any]) -> Tensor:
        """The bias-corrected second moment v-hat that divides the step (module docstring), before the z^2 floor.

        Args:
            group: the parameter's group.
            state: its state.

        Returns:
            A new tensor.
        """
        beta2 = group["betas"][1]
        if self.tracks_second_moment:
            return state["shared"] / (1 - beta2 ** state["step"])
        local = state["v"] / (1 - beta2 ** state["step"])
        if not self.second_moment_every or not state["samples"]:
            return local
        shared = state["shared"] / (1 - (beta2**self.second_moment_every) ** state["samples"])
        return torch.maximum(shared, local.div_(group["workers"]), out=shared)  # both are new: written in place

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The update (phase 3) on what ``.grad`` holds: the tracker z_i, or h_i without one.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._prepared:
            self.prepare_momentum()
        self._prepared = False
        for group, params, states, foreach in self._with_gradients():
            beta1, lr = group["betas"][0], group["lr"]
            if self.tracks_second_moment:
                self._advance_from_tracker(group, params, states, foreach)
            if foreach:
                self._foreach_update(group, params, states)
                continue
            for p, state in zip(params, states, strict=True):
                first = p.grad / (1 - beta1 ** state["step"])
                second = self.second_moment(group, state)  # a new tensor, so the maximum is written into it
                denominator = torch.maximum(second, first.square(), out=second).sqrt_()
                p.mul_(1 - lr * group["weight_decay"])
                p.addcdiv_(first, denominator.add_(group["eps"]), value=-lr)
        return loss

    @staticmethod
    def _advance_from_tracker(
        group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]], foreach: bool
    ) -> None:
        r"""``second_moment="tracker"``: :math:`u_i \leftarrow \beta_2 u_i + (1-\beta_2)\, r_i^2` with
        :math:`r_i = d_i / (1-\beta_1)`, :math:`d_i = z_i^t - \beta_1 z_i^{t-1}`, computed as
        :math:`\beta_2 u_i + \frac{1-\beta_2}{(1-\beta_1)^2} d_i^2` (one pass fewer), then keep :math:`z_i^t`
        (module docstring); the ``torch._foreach_*`` kernels run the same operations in the same order."""
        beta1, beta2 = group["betas"]
        weight = (1 - beta2) / (1 - beta1) ** 2
        trackers, last, u = [p.grad for p in params], [st["last"] for st in states], [st["shared"] for st in states]
        if foreach:
            changes = torch._foreach_add(trackers, last, alpha=-beta1)
            torch._foreach_mul_(u, beta2)
            torch._foreach_addcmul_(u, changes, changes, value=weight)
            torch._foreach_copy_(last, trackers)
            return
        for z, z_last, u_i in zip(trackers, last, u, strict=True):
            change = torch.add(z, z_last, alpha=-beta1)
            u_i.mul_(beta2).addcmul_(change, change, value=weight)
            z_last.copy_(z)

    def _foreach_update(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]]) -> None:
        """The update of :meth:`step` with ``torch._foreach_*`` kernels: the same operations in the same order per
        tensor (:meth:`second_moment`'s included), so on the CPU the same results bit for bit."""
        (beta1, beta2), lr = group["betas"], group["lr"]
        first = torch._foreach_div([p.grad for p in params], [1 - beta1 ** st["step"] for st in states])
        second_key = "shared" if self.tracks_second_moment else "v"
        second = list(torch._foreach_div([st[second_key] for st in states], [1 - beta2 ** st["step"] for st in states]))
        sampled = [i for i, st in enumerate(states) if self.second_moment_every and st["samples"]]
        if sampled:
            rate = beta2**self.second_moment_every
            shared = torch._foreach_div(
                [states[i]["shared"] for i in sampled], [1 - rate ** states[i]["samples"] for i in sampled]
            )
            floors = torch._foreach_div([second[i] for i in sampled], group["workers"])
            for i, value in zip(sampled, torch._foreach_maximum(shared, floors), strict=True):
                second[i] = value
        denominator = torch._foreach_maximum(second, torch._foreach_pow(first, 2))
        torch._foreach_sqrt_(denominator)
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_add_(denominator, group["eps"])
        torch._foreach_addcdiv_(params, first, denominator, value=-lr)
