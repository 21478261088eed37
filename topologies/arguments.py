"""Integer arguments of the schedule constructors, the registry and the CLI: one rule for all of them.

An integer argument (n, rows, cols, degree, seed, per_node, nodes, period, window) is anything
:func:`operator.index` accepts -- ``int``, numpy integers, any type with ``__index__`` -- and is stored as a
Python ``int``, so a schedule built from ``np.int64(8)`` is the schedule built from ``8`` (same parameters, same
fingerprint). ``bool`` (and ``numpy.bool_``) is refused although it is an ``int`` subclass: ``ring(True)`` is
a mistake, not one rank.
"""

from __future__ import annotations

import operator

import numpy as np

from topologies.validation import ScheduleError


def integer(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as a Python int, checked by the rule of this module.

    Args:
        name: the argument's name, used in the error message.
        value: the value given: anything :func:`operator.index` accepts, except a bool.
        minimum: the smallest value accepted; None accepts any integer.

    Returns:
        ``value`` as a Python ``int``.

    Raises:
        ScheduleError: ``value`` is a bool, is not an integer, or is below ``minimum``.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ScheduleError(f"{name} must be an integer, got the bool {name}={value!r}; pass an int")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ScheduleError(
            f"{name} must be an integer (int or numpy integer), got {name}={value!r} of type {type(value).__name__}"
        ) from None
    if minimum is not None and number < minimum:
        raise ScheduleError(f"{name} must be an integer >= {minimum}, got {name}={number}")
    return number
