r"""AccumAdam and AccumAdamW: Adam whose moments advance once per ``accum_iter`` local steps.

Source: Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training", arXiv 2410.11998 (ICLR 2025); reference code ``WangZesen/Decent-DP``
(``decent_dp/optim.py::accum_adam_foreach`` / ``accum_adamw_foreach``). Specification: docs/design.md B.3.

Why: in decentralized training with a fixed global batch B and n workers, each worker estimates Adam's
moments from B/n samples, so the second moment is dominated by gradient noise. AccumAdam refreshes the
moments once every A local steps with the mean of the last A local gradients (temporal averaging on one
worker in place of All-Reduce's spatial averaging), while the parameters still move (and are mixed with
the neighbours by the wrapper) on every step. With A = 1 it is exactly Adam / AdamW.

When it pays: where each worker's batch is a few samples and the run is long enough to repay the moments' slower
start (they advance once per A steps, which costs early in a run). Where that is, and how it compares with AdamW, is
measured in experiments/learning_per_step/README.md, "AccumAdamW with 16 workers of one sequence each". Raise beta2
with A, since the moments see A times fewer updates (the paper's configurations: docs/design.md B.4).

These optimizers never communicate; see ``optim/__init__.py`` for where mixing enters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optim.hyperparameters import validate_adam_hyperparameters

__all__ = ["AccumAdam", "AccumAdamW"]

_ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


def _validate_hyperparameters(settings: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the offending hyper-parameter (and ``where`` it was given)."""
    validate_adam_hyperparameters(settings, where)
    accum_iter = settings["accum_iter"]
    if not isinstance(accum_iter, Integral) or isinstance(accum_iter, bool) or accum_iter < 1:
        raise ValueError(f"{where}: accum_iter must be an integer >= 1, got {accum_iter!r}")


@dataclass(frozen=True)
class _GroupSettings:
    """One param group's hyper-parameters, read once per step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    accum_iter: int
    decoupled_weight_decay: bool
    maximize: bool

    @classmethod
    def of(cls, group: dict[str, Any]) -> _GroupSettings:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            accum_iter=int(group["accum_iter"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
            maximize=bool(group["maximize"]),
        )

    def step_size_and_bias_sqrt(self, step: int) -> tuple[float, float]:
        """Return (lr / (1 - beta1^tau), sqrt(1 - beta2^tau)) with tau = ceil(step / A)."""
        tau = -(-step // self.accum_iter)
        return self.lr / (1.0 - self.beta1**tau), math.sqrt(1.0 - self.beta2**tau)


class AccumAdam(Optimizer):
    r"""Adam with moments refreshed every ``accum_iter`` steps from the mean of the last local gradients.

    Per parameter tensor x, with A = ``accum_iter``, learning rate :math:`\eta`, L2 coefficient
    :math:`\lambda` (``weight_decay``) and state: step k (0), M (0), V (0), S (0). M and V are stored
    *pre-multiplied* by :math:`\beta_1`, :math:`\beta_2`; S holds the running mean of the last <= A gradients.
    Each call to :meth:`step`, with g the gradient at the current x (negated if ``maximize``):

    1. k <- k + 1.
    2. Weight decay. Adam (this class, default): g <- g + :math:`\lambda` x, so the decay also enters S.
       Decoupled (``decoupled_weight_decay=True`` or :class:`AccumAdamW`): x <- x (1 - :math:`\eta\lambda`).
    3. S <- S + g / A.
    4. Provisional moments from the frozen state and the current gradient:
       :math:`\tilde M = M + (1-\beta_1) g`, :math:`\tilde V = V + (1-\beta_2) g^2`.
    5. Bias correction with :math:`\tau = \lceil k/A \rceil`, the number of moment rounds including the
       current one:
       :math:`x \leftarrow x - \frac{\eta}{1-\beta_1^\tau}\,\tilde M \,/\,
       \big(\sqrt{\tilde V}/\sqrt{1-\beta_2^\tau} + \epsilon\big)`.
       The parameters therefore move on **every** step.
    6. If k mod A == 0, commit one moment round with the averaged gradient:
       :math:`M \leftarrow \beta_1 (M + (1-\beta_1) S)`, :math:`V \leftarrow \beta_2 (V + (1-\beta_2) S^2)`,
       S <- 0.

    Consequences: with A = 1 this is exactly ``torch.optim.Adam`` (``AdamW`` for the decoupled variant);
    the stored M equals :math:`\beta_1` times the usual EMA of the A-step mean gradients. The step counter is
    per parameter (as in torch), so a parameter whose grad is ``None`` is skipped and its window pauses.
    Complex parameters are treated as pairs of reals (as torch's Adam does). Sparse gradients are refused.

    Args:
        params: parameters or param groups (dicts), as for any ``torch.optim.Optimizer``.
        lr: learning rate :math:`\eta` (default 1e-3).
        betas: (:math:`\beta_1`, :math:`\beta_2`), each in [0, 1) (default (0.9, 0.999)).
        eps: :math:`\epsilon` added to the denominator (default 1e-8).
        weight_decay: :math:`\lambda` (default 0).
        accum_iter: A, the number of local steps per moment round, an integer >= 1 (default 4). The
            reference scales it with the number of workers n, roughly n/4 ... n/2 (docs/design.md B.3).
        decoupled_weight_decay: decay the parameters directly (AdamW) instead of adding L2 to the gradient.
        maximize: maximize the objective instead of minimizing it.
        foreach: use the ``torch._foreach_*`` kernels (bit-identical to the per-tensor loop on CPU);
            ``None`` picks them when every parameter of the group is on CUDA.

    Raises:
        ValueError: a hyper-parameter is out of range (lr, eps or weight_decay negative or not finite, a beta outside
            [0, 1), accum_iter not an integer >= 1); the message names it and where it was given.

    Examples:
        >>> opt = AccumAdam(model.parameters(), lr=1e-3, accum_iter=8)
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: _ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_iter: int = 4,
        *,
        decoupled_weight_decay: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "accum_iter": accum_iter,
            "decoupled_weight_decay": decoupled_weight_decay,
            "maximize": maximize,
            "foreach": foreach,
        }
        _validate_hyperparameters(defaults, f"{type(self).__name__} arguments")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as torch does) and refuse invalid per-group hyper-parameters.

        Args:
            param_group: a dict with ``"params"`` and optionally any hyper-parameter of the constructor; the
                missing ones take the optimizer's defaults.

        Raises:
            ValueError: a hyper-parameter of the group is out of range (as for the constructor), or a parameter
                already belongs to another group (torch's check).
        """
        where = f"{type(self).__name__} param group {len(self.param_groups)}"
        if isinstance(param_group, dict):  # torch's own check below names a non-dict group
            _validate_hyperparameters({**self.defaults, **param_group}, where)
        super().add_param_group(param_group)

    def _collect(self, group_index: int, group: dict[str, Any]) -> tuple[list[Tensor], ...]:
        """Lists of (params, grads, M, V, S, steps) for the params with a grad; lazily creates state."""
        params, grads, moment1, moment2, accums, steps = [], [], [], [], [], []
        for param_index, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients (param group {group_index}, "
                    f"parameter {param_index}, shape {tuple(param.shape)}); use torch.optim.SparseAdam "
                    "or a dense embedding"
                )
            state = self.state[param]
            if len(state) == 0:
                state["step"] = torch.tensor(0, dtype=torch.int64)
                state["beta1_exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["beta2_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["grad_accum"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            as_real = torch.view_as_real if torch.is_complex(param) else (lambda tensor: tensor)
            params.append(as_real(param))
            grads.append(as_real(param.grad))
            moment1.append(as_real(state["beta1_exp_avg"]))
            moment2.append(as_real(state["beta2_exp_avg_sq"]))
            accums.append(as_real(state["grad_accum"]))
            steps.append(state["step"])
        return params, grads, moment1, moment2, accums, steps

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (algorithm in the class docstring).

        Parameters whose ``grad`` is None are skipped; their step counter and accumulation window pause.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The loss the closure returned, or None without a closure.

        Raises:
            ValueError: a parameter has a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            params, grads, moment1, moment2, accums, steps = self._collect(group_index, group)
            if not params:
                continue
            settings = _GroupSettings.of(group)
            foreach = group["foreach"]
            if foreach is None:
                foreach = all(param.is_cuda for param in params)
            kernel = _foreach_accum_adam if foreach else _single_tensor_accum_adam
            kernel(params, grads, moment1, moment2, accums, steps, settings)
        return loss


class AccumAdamW(AccumAdam):
    r"""AccumAdam with decoupled weight decay, x <- x (1 - lr * weight_decay) every step (AdamW style).

    Same algorithm as :class:`AccumAdam` (step 2 uses the decoupled branch); with ``accum_iter=1`` it is
    exactly ``torch.optim.AdamW``. Default ``weight_decay=1e-2`` as in torch. Sources: arXiv 2410.11998,
    Decent-DP ``accum_adamw_foreach``; docs/design.md B.3.

    Args:
        params: parameters or param groups (dicts), as for any ``torch.optim.Optimizer``.
        lr: learning rate (default 1e-3).
        betas: (beta1, beta2), each in [0, 1) (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: the decoupled decay coefficient lambda, x <- x (1 - lr * lambda) (default 1e-2).
        accum_iter: A, the number of local steps per moment round, an integer >= 1 (default 4).
        maximize: maximize the objective instead of minimizing it.
        foreach: use the ``torch._foreach_*`` kernels; ``None`` picks them when every parameter of the group is
            on CUDA.

    Raises:
        ValueError: a hyper-parameter is out of range; the message names it and where it was given.
    """

    def __init__(
        self,
        params: _ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        accum_iter: int = 4,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            accum_iter=accum_iter,
            decoupled_weight_decay=True,
            maximize=maximize,
            foreach=foreach,
        )


def _single_tensor_accum_adam(
    params: list[Tensor],
    grads: list[Tensor],
    moment1: list[Tensor],
    moment2: list[Tensor],
    accums: list[Tensor],
    steps: list[Tensor],
    hp: _GroupSettings,
) -> None:
    """Steps 1-6 of the AccumAdam docstring, one tensor at a time."""
    for param, grad, m, v, s, step_t in zip(params, grads, moment1, moment2, accums, steps, strict=True):
        step_t += 1
        step = int(step_t.item())
        if hp.maximize:
            grad = torch.neg(grad)
        if hp.weight_decay != 0:
            if hp.decoupled_weight_decay:
                param.mul_(1.0 - hp.lr * hp.weight_decay)
            else:
                grad = grad.add(param, alpha=hp.weight_decay)
        s.add_(grad, alpha=1.0 / hp.accum_iter)
        provisional_m = m.add(grad, alpha=1.0 - hp.beta1)
        denom = v.addcmul(grad, grad, value=1.0 - hp.beta2)
        step_size, bias_correction2_sqrt = hp.step_size_and_bias_sqrt(step)
        denom.sqrt_().div_(bias_correction2_sqrt).add_(hp.eps)
        param.addcdiv_(provisional_m, denom, value=-step_size)
        if step % hp.accum_iter == 0:
            m.add_(s, alpha=1.0 - hp.beta1).mul_(hp.beta1)
            v.addcmul_(s, s, value=1.0 - hp.beta2).mul_(hp.beta2)
            s.zero_()


def _foreach_accum_adam(
    params: list[Tensor],
    grads: list[Tensor],
    moment1: list[Tensor],
    moment2: list[Tensor],
    accums: list[Tensor],
    steps: list[Tensor],
    hp: _GroupSettings,
) -> None:
    """Steps 1-6 of the AccumAdam docstring with ``torch._foreach_*`` ops, per (device, dtype) bucket.

    Same operations in the same order as :func:`_single_tensor_accum_adam`, so the results are identical.
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, param in enumerate(params):
        buckets.setdefault((param.device, param.dtype), []).append(index)
    for indices in buckets.values():
        p = [params[i] for i in indices]
        g = [grads[i] for i in indices]
        m = [moment1[i] for i in indices]
        v = [moment2[i] for i in indices]
        s = [accums[i] for i in indices]
        step_numbers = []
        for i in indices:
            steps[i] += 1
            step_numbers.append(int(steps[i].item()))
        if hp.maximize:
            g = torch._foreach_neg(g)
        if hp.weight_decay != 0:
            if hp.decoupled_weight_decay:
                torch._foreach_mul_(p, 1.0 - hp.lr * hp.weight_decay)
            else:
                g = torch._foreach_add(g, p, alpha=hp.weight_decay)
        torch._foreach_add_(s, g, alpha=1.0 / hp.accum_iter)
        provisional_m = torch._foreach_add(m, g, alpha=1.0 - hp.beta1)
        denom = torch._foreach_addcmul(v, g, g, value=1.0 - hp.beta2)
        corrections = [hp.step_size_and_bias_sqrt(step) for step in step_numbers]
        torch._foreach_sqrt_(denom)
        torch._foreach_div_(denom, [bias_sqrt for _, bias_sqrt in corrections])
        torch._foreach_add_(denom, hp.eps)
        torch._foreach_addcdiv_(p, provisional_m, denom, [-step_size for step_size, _ in corrections])
        commit = [j for j, step in enumerate(step_numbers) if step % hp.accum_iter == 0]
        if commit:
            m_commit, v_commit, s_commit = ([tensors[j] for j in commit] for tensors in (m, v, s))
            torch._foreach_add_(m_commit, s_commit, alpha=1.0 - hp.beta1)
            torch._foreach_mul_(m_commit, hp.beta1)
            torch._foreach_addcmul_(v_commit, s_commit, s_commit, value=1.0 - hp.beta2)
            torch._foreach_mul_(v_commit, hp.beta2)
            torch._foreach_zero_(s_commit)
