"""Argument types of the main job's command line: a number parsed and checked against its range.

Each type raises :class:`argparse.ArgumentTypeError`, so argparse names the option in its error:
``argument --lr: must be positive and finite, got '-1'``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type, accepts: Callable[[float], bool], requirement: str) -> Callable[[str], int | float]:
    """An argparse type: ``kind(text)``, refused unless ``accepts`` it.

    Args:
        kind: ``int`` or ``float``.
        accepts: the range check on the parsed value.
        requirement: what the error says a refused value must be (e.g. "must be >= 0").

    Returns:
        The parser.
    """
    article = "an" if kind.__name__[0] in "aeiou" else "a"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {article} {kind.__name__}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{requirement}, got {text!r}")
        return value

    return parse


def positive(kind: type) -> Callable[[str], int | float]:
    """An argparse type for a positive, finite number.

    Args:
        kind: ``int`` or ``float``.

    Returns:
        The parser.
    """
    return number(kind, lambda value: value > 0 and math.isfinite(value), "must be positive and finite")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type for an int >= ``low``.

    Args:
        low: the smallest value accepted.

    Returns:
        The parser.
    """
    return number(int, lambda value: value >= low, f"must be >= {low}")  # type: ignore[return-value]


def in_unit_interval(*, include_one: bool) -> Callable[[str], float]:
    """An argparse type for a float in [0, 1] (a mixing weight) or [0, 1) (a momentum).

    Args:
        include_one: whether 1 is accepted.

    Returns:
        The parser.
    """
    if include_one:
        return number(float, lambda value: 0 <= value <= 1, "must be in [0, 1]")  # type: ignore[return-value]
    return number(float, lambda value: 0 <= value < 1, "must be in [0, 1)")  # type: ignore[return-value]
