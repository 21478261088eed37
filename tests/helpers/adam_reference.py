"""Where AdamW's own moments allow a step longer than lr: the coordinates a momentum-tracking optimizer's z^2
floor shortens (optim/momentum_tracking.py), which tests comparing it with AdamW must leave out."""

from __future__ import annotations

import torch


def where_adams_m_squared_exceeds_v(gradients: list[torch.Tensor], betas: tuple[float, float]) -> torch.Tensor:
    """The coordinates where AdamW with ``betas`` fed ``gradients`` ever has its bias-corrected m^2 above v.

    Args:
        gradients: one gradient per step.
        betas: AdamW's (beta1, beta2).

    Returns:
        A boolean mask of the gradients' shape.
    """
    beta1, beta2 = betas
    m, v = torch.zeros_like(gradients[0]), torch.zeros_like(gradients[0])
    exceeds = torch.zeros(gradients[0].shape, dtype=torch.bool)
    for t, gradient in enumerate(gradients, start=1):
        m.lerp_(gradient, 1 - beta1)
        v.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        exceeds |= (m / (1 - beta1**t)).square() > v / (1 - beta2**t) * (1 + 1e-12)  # t = 1: m^2 = v = g^2
    return exceeds
