"""The calendar of a wrapper that acts every H-th step and runs another algorithm on the steps between.

Training step s (counted from 0) ends a period when (s + 1) mod H = 0: steps H - 1, 2H - 1, ...; it is then the
k-th such step, k = (s + 1) / H - 1 (from 0). The algorithm between runs on the other steps under its own step
numbers, which skip the period ends:

.. math::  b(s) = s - \\lfloor (s + 1) / H \\rfloor, \\qquad s(b) = b + \\lfloor b / (H - 1) \\rfloor \\quad (H \\ge 2),

so it sees 0, 1, 2, ... without gaps and its own schedules (e.g. a one-peer hypercube) stay in their order.
:class:`gossip.PeriodicAverage` (a global average every H steps) and :class:`gossip.OuterOptimizer` (an outer step
every H steps) keep their calendar here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Period:
    """Every ``length``-th training step ends a period (``length`` >= 1, checked by the owner).

    Attributes:
        length: H, training steps per period.
    """

    length: int

    def ends(self, step: int) -> bool:
        """Whether training step ``step`` ends a period: (step + 1) % H == 0.

        Args:
            step: a training step.

        Returns:
            True on a period's last step.
        """
        return (step + 1) % self.length == 0

    def index(self, step: int) -> int:
        """Which period a period-ending step ends, counted from 0: (step + 1) // H - 1.

        Args:
            step: a training step for which :meth:`ends` holds.

        Returns:
            The period's index.
        """
        return (step + 1) // self.length - 1

    def between(self, step: int) -> int:
        """The algorithm between's own step number for a training step that ends no period: step - (step + 1) // H.

        Args:
            step: a training step for which :meth:`ends` does not hold.

        Returns:
            The step number the algorithm between runs.
        """
        return step - (step + 1) // self.length

    def training_step(self, between_step: int) -> int:
        """The training step that ran the algorithm between's step ``between_step`` (H >= 2): b + b // (H - 1).

        Args:
            between_step: a step number of the algorithm between.

        Returns:
            The training step, the inverse of :meth:`between`.
        """
        return between_step + between_step // (self.length - 1)
