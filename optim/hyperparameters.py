"""Checks of Adam's hyper-parameters, shared by this package's Adam variants."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any


def validate_adam_hyperparameters(settings: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the offending hyper-parameter (and ``where`` it was given).

    Args:
        settings: a param group (or the defaults) holding ``lr``, ``eps``, ``weight_decay`` and ``betas``.
        where: what the message names as the source, e.g. ``"AccumAdamW arguments"``.

    Raises:
        ValueError: ``lr``, ``eps`` or ``weight_decay`` is not a finite number >= 0, or ``betas`` is not a pair of
            numbers in [0, 1).
    """

    def is_real(value: Any) -> bool:
        return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)

    lr, eps, weight_decay = settings["lr"], settings["eps"], settings["weight_decay"]
    if not is_real(lr) or lr < 0:
        raise ValueError(f"{where}: lr must be a finite float >= 0, got {lr!r}")
    if not is_real(eps) or eps < 0:
        raise ValueError(f"{where}: eps must be a finite float >= 0, got {eps!r}")
    if not is_real(weight_decay) or weight_decay < 0:
        raise ValueError(f"{where}: weight_decay must be a finite float >= 0, got {weight_decay!r}")
    betas = settings["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if not is_real(beta) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{where}: betas[{index}] must lie in [0, 1), got {beta!r}")
