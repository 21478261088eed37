"""Split a module's parameters into a weight-decay group and a no-decay group.

Rule (common practice, e.g. nanoGPT; docs/design.md B.1 "Bug to avoid" and B.4, none on BatchNorm and biases): tensors
with ndim >= 2 (linear and convolution weights, embeddings) are decayed; tensors with ndim <= 1 (biases,
BatchNorm / LayerNorm scales and shifts, scalars) are not. Decent-DP's
``decent_dp/optim.py::_get_param_groups`` has the two groups swapped; this is the correct version.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

__all__ = ["param_groups"]


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Return ``[decay_group, no_decay_group]`` for ``module``'s trainable parameters.

    The first group holds every parameter with ``ndim >= 2`` and ``weight_decay=weight_decay``; the second
    holds the 1-D and 0-D ones with ``weight_decay=0.0``. Parameters with ``requires_grad=False`` are left
    out; shared parameters appear once. Either list may be empty (torch optimizers accept that).

    Args:
        module: the model whose parameters are split.
        weight_decay: the decay of the first group, a finite float >= 0.

    Returns:
        The two param groups, ready for any ``torch.optim.Optimizer``.

    Raises:
        ValueError: ``weight_decay`` is not a finite number >= 0 (a bool included).

    Examples:
        >>> opt = optim.AccumAdamW(optim.param_groups(model, weight_decay=0.1), lr=6e-4)
    """
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise ValueError(f"param_groups: weight_decay must be a float >= 0, got {weight_decay!r}")
    if not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"param_groups: weight_decay must be a finite float >= 0, got {weight_decay!r}")
    decay, no_decay = [], []
    for parameter in module.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
