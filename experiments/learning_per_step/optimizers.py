"""AdamW variants of the learning-per-step study (harness-level): each changes only the second moment that divides
the step, to test whether a better estimate of the mean gradient's second moment closes per-worker Adam's gap to
DDP. Used by :mod:`experiments.learning_per_step`; experiments/learning_per_step/README.md, "the gap is per-worker
Adam", has the results."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import optim


def _with_gradients(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, torch.Tensor, dict]]:
    """(param group, parameter, its state) for every parameter of ``optimizer`` that has a gradient."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p, optimizer.state[p]


class _StudyAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, per-tensor loop) whose bias-corrected second moment :meth:`second_moment`
    gives; state m, v and one more buffer, ``extra``, per parameter. For the study's variants."""

    extra = "s"

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

    def second_moment(self, state: dict, g: torch.Tensor, beta2: float) -> torch.Tensor:
        """Advance the second-moment state with gradient ``g`` (before m moves) and return its estimate."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group, p, state in _with_gradients(self):
            beta1, beta2 = group["betas"]
            if not state:
                state["step"] = 0
                state["m"], state["v"], state[self.extra] = (torch.zeros_like(p) for _ in range(3))
            state["step"] += 1
            estimate = self.second_moment(state, p.grad, beta2)
            state["m"].lerp_(p.grad, 1 - beta1)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(
                state["m"], estimate.sqrt_().add_(group["eps"]), value=-group["lr"] / (1 - beta1 ** state["step"])
            )


class NoiseDebiasedAdamW(_StudyAdamW):
    r"""AdamW whose second moment estimates that of the mean gradient over ``workers``, from local statistics only
    (harness-level, for the study).

    A worker's gradient :math:`g_i = g + \xi_i` (noise variance :math:`\sigma^2` per coordinate) has
    :math:`E[g_i^2] = g^2 + \sigma^2`, while DDP's Adam, fed the mean over n workers, sees
    :math:`E[\bar g^2] = g^2 + \sigma^2 / n`: a decentralized Adam divides the noisy coordinates by a
    denominator up to :math:`\sqrt n` too large. With :math:`s`, the EMA (rate :math:`\beta_2`) of the squared
    prediction error :math:`(g_i - m_i)^2` -- AdaBelief's statistic (Zhuang et al., NeurIPS 2020), about
    :math:`\sigma^2` where m tracks g -- the update divides by the square root of

    .. math::  \hat v = \max\big(v - (1 - 1/n)\, s,\; v / n\big)

    (bias-corrected like v), an estimate of :math:`g^2 + \sigma^2/n`. Decoupled weight decay as AdamW.
    """

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, workers: int) -> None:
        super().__init__(params, lr, betas, eps)
        self.workers = workers

    def second_moment(self, state: dict, g: torch.Tensor, beta2: float) -> torch.Tensor:
        m, v, s = state["m"], state["v"], state["s"]
        s.mul_(beta2).addcmul_(g - m, g - m, value=1 - beta2)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        shrink = 1.0 - 1.0 / self.workers
        return torch.maximum(v - shrink * s, v / self.workers).div_(1 - beta2 ** state["step"])


class SmoothedSecondMomentAdamW(_StudyAdamW):
    r"""AdamW whose second moment is taken of a short EMA of the local gradients rather than of the gradient itself
    (harness-level, for the study).

    A worker's gradient :math:`g_i = g + \xi_i` (iid noise of variance :math:`\sigma^2` per coordinate and step)
    makes :math:`E[g_i^2] = g^2 + \sigma^2`, while DDP's Adam, fed the mean of n workers' gradients, sees
    :math:`E[\bar g^2] = g^2 + \sigma^2/n`. An EMA :math:`u \leftarrow \beta_u u + (1-\beta_u) g_i` has stationary
    noise variance :math:`\frac{1-\beta_u}{1+\beta_u}\sigma^2`, which equals :math:`\sigma^2/n` at
    :math:`\beta_u = \frac{n-1}{n+1}`: averaging over time stands in for averaging over workers (the idea of
    AccumAdam, Wang et al., ICLR 2025, Sec. 3, without freezing the moments between rounds). Then
    :math:`v \leftarrow \beta_2 v + (1-\beta_2)\hat u^2` with :math:`\hat u = u/(1-\beta_u^t)`, and the update is
    AdamW's :math:`-\mathrm{lr}\,\hat m/(\sqrt{\hat v}+\epsilon)`. ``v_beta = β1`` gives AdaMomentum's
    :math:`v = \mathrm{EMA}(m^2)` (Wang et al., "Rethinking Adam", 2021).
    """

    extra = "u"

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, v_beta: float) -> None:
        super().__init__(params, lr, betas, eps)
        self.v_beta = v_beta

    def second_moment(self, state: dict, g: torch.Tensor, beta2: float) -> torch.Tensor:
        t, v, u = state["step"], state["v"], state["u"]
        u.lerp_(g, 1 - self.v_beta)
        smoothed = u / (1 - self.v_beta**t)
        v.mul_(beta2).addcmul_(smoothed, smoothed, value=1 - beta2)
        return v / (1 - beta2**t)


class SharedSecondMomentAdamW(_StudyAdamW):
    r"""AdamW whose second moment is that of the mean gradient over all workers, sampled every K steps and the same
    on every rank; the first moment stays local (harness-level, for the study).

    With one v on every rank the update :math:`-\mathrm{lr}\,\hat m_i/(\sqrt{\hat v}+\epsilon)` is linear in
    the local first moment, so the mean of the workers' updates is the update of the mean gradient's first moment --
    DDP's AdamW step -- where each worker dividing by its own :math:`E[g_i^2] = g^2 + \sigma^2` is not (the
    per-worker-Adam floor of the study's README.md). Every K-th step the harness all-reduces a copy of the
    gradients (:meth:`sample`: :math:`2\frac{n-1}{n} M / K` bytes per worker per step on average) and the shared
    estimate advances with the square of the mean, at the rate :math:`\beta_2^K` per sample (the same time
    constant in steps); between samples it stays. A coordinate whose mean gradient was zero at the last sample (an
    embedding row no batch touched) would then be divided by zero until the next, so the estimate is floored by
    :math:`v_i / n`, the worker's own second moment (kept every step) divided by n: the mean gradient's second
    moment where the workers' gradients are independent noise (``floor=n``; None: no floor). Bias-corrected over
    the samples taken (the floor over the steps). Sampled every step from its own gradient, it is AdamW.
    """

    extra = "shared"  # the shared estimate: m, v (the worker's own, for the floor) and it, as _StudyAdamW makes them

    def __init__(
        self, params: Any, lr: float, betas: tuple[float, float], eps: float, every: int, floor: int | None
    ) -> None:
        super().__init__(params, lr, betas, eps)
        self.every, self.floor = every, floor  # floor: n, or None for none

    def sample(self, means: dict[torch.Tensor, torch.Tensor]) -> None:
        """Take the mean gradient of each parameter (keyed by the parameter) for the next step's estimate."""
        for group in self.param_groups:
            rate = group["betas"][1] ** self.every
            for p in group["params"]:
                if p not in means:
                    continue
                state = self.state[p]
                if not state:  # sampled before its first step: the state _StudyAdamW.step would make
                    state["step"] = 0
                    state["m"], state["v"], state["shared"] = (torch.zeros_like(p) for _ in range(3))
                state["shared"].mul_(rate).addcmul_(means[p], means[p], value=1 - rate)
                state["samples"] = state.get("samples", 0) + 1

    def second_moment(self, state: dict, g: torch.Tensor, beta2: float) -> torch.Tensor:
        v = state["v"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if not state.get("samples"):  # no sample yet: the worker's own
            return v / (1 - beta2 ** state["step"])
        shared = state["shared"] / (1 - (beta2**self.every) ** state["samples"])
        if self.floor is None:
            return shared
        return torch.maximum(shared, v / ((1 - beta2 ** state["step"]) * self.floor))


class TrackedMomentumAdamW(optim.MomentumTrackingAdamW):
    r""":class:`optim.MomentumTrackingAdamW` with the study's second-moment sources (harness-level).

    ``v_source``: ``"local"`` the rank's own bias-corrected EMA of :math:`g_i^2` (``second_moment_every=0``);
    ``"shared"`` the mean gradient's, sampled every ``every`` steps, floored by the local one over n unless
    ``local_floor=False`` (the study's runs keep it); ``"debiased"`` :class:`NoiseDebiasedAdamW`'s local estimate of
    the mean gradient's second moment, :math:`\max(v - (1 - 1/n)\,s,\; v/n)` with s AdaBelief's EMA of
    :math:`(g_i - h_i)^2` against the previous first moment. The wrapper samples the mean gradient and prepares
    the first moment as for the library's optimizer (``gossip/wrapper/momentum.py``).
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        v_source: str,
        workers: int,
        every: int,
        local_floor: bool = True,
    ) -> None:
        if v_source not in ("local", "debiased", "shared"):
            raise ValueError(f"v_source must be 'local', 'debiased' or 'shared', got {v_source!r}")
        shared_every = every if v_source == "shared" else 0
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=0.0, second_moment_every=shared_every)
        self.v_source, self.workers, self.local_floor = v_source, workers, local_floor

    @torch.no_grad()
    def prepare_momentum(self) -> None:
        if self.v_source == "debiased":  # AdaBelief's (g - h)^2 against the previous first moment, before h moves
            for group, p, state in self._with_gradients():
                beta2, error = group["betas"][1], p.grad - state["h"]
                state.setdefault("s", torch.zeros_like(p)).mul_(beta2).addcmul_(error, error, value=1 - beta2)
        super().prepare_momentum()

    def second_moment(self, group: dict[str, Any], state: dict[str, Any]) -> torch.Tensor:
        beta2 = group["betas"][1]
        if self.v_source == "debiased":
            local = state["v"] / (1 - beta2 ** state["step"])
            s = state["s"] / (1 - beta2 ** state["step"])
            return torch.maximum(local - (1 - 1 / self.workers) * s, local / self.workers)
        if self.v_source == "shared" and not self.local_floor and state["samples"]:
            return state["shared"] / (1 - (beta2**self.second_moment_every) ** state["samples"])
        return super().second_moment(group, state)
