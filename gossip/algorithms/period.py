"""The calendar and step loop of a wrapper that acts every H-th step and runs another algorithm on the steps between.

Training step s (counted from 0) ends a period when (s + 1) mod H = 0: steps H - 1, 2H - 1, ...; it is then the
k-th such step, k = (s + 1) / H - 1 (from 0). The algorithm between runs on the other steps under its own step
numbers, which skip the period ends:

.. math::  b(s) = s - \\lfloor (s + 1) / H \\rfloor, \\qquad s(b) = b + \\lfloor b / (H - 1) \\rfloor \\quad (H \\ge 2),

so it sees 0, 1, 2, ... without gaps and its own schedules (e.g. a one-peer hypercube) stay in their order.
:class:`gossip.PeriodicAverage` (a global average every H steps) and :class:`gossip.OuterOptimizer` (an outer step
every H steps) keep their calendar here, and share one step loop, :class:`EveryPeriod`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gossip.algorithms.base import Algorithm
from gossip.errors import GossipError


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


@dataclass
class PeriodStep:
    """What :meth:`EveryPeriod.start` returned for one training step.

    Attributes:
        step: the training step.
        at_period_end: what the subclass's :meth:`EveryPeriod._start_period_end` returned, on a period's last step.
        between: what ``between.start`` returned, on the other steps.
    """

    step: int
    at_period_end: Any = None
    between: Any = None


class EveryPeriod(Algorithm):
    """The step loop of an algorithm that acts on every H-th step and runs ``between`` on the steps in between.

    :class:`gossip.PeriodicAverage` (a global average) and :class:`gossip.OuterOptimizer` (an outer step) are this
    loop with their own period end: on a period's last step (:class:`Period`) ``start`` calls the subclass's
    :meth:`_start_period_end`; on the others it runs ``between`` (if any) at its own gap-free step number, keeping
    ``between``'s state from before that start (a checkpoint taken during the step holds it), and names both
    numbers in any error ``between`` raises. ``finish`` completes ``between``'s step, then calls
    :meth:`_finish_step_end` on every step (a delayed period end may land on a later one).

    Subclasses set ``self.between`` (an algorithm or None) and ``self._period_length`` in their constructor, bind
    ``between`` in ``setup``, and implement :meth:`_start_period_end` and :meth:`_finish_step_end`.
    """

    _label = "EveryPeriod"
    between: Algorithm | None
    _period_length: int

    @property
    def period(self) -> Period:
        """The calendar: which steps end a period, and ``between``'s step numbers."""
        return Period(self._period_length)

    @contextlib.contextmanager
    def _naming_training_step(self, step: int) -> Iterator[None]:
        """Add to an error ``between`` raises at training step ``step`` which of its own steps that is."""
        try:
            yield
        except GossipError as error:
            if error.args and isinstance(error.args[0], str) and self.between is not None:
                note = f" [{self.between.name} step {self.period.between(step)} is step {step} of {self._label}]"
                error.args = (error.args[0] + note, *error.args[1:])
            raise

    def _parts(self) -> list[Algorithm]:
        """The bound parts whose deferred non-finite checks this composite runs (``between`` by default)."""
        return [self.between] if self.between is not None else []

    def check_deferred(self) -> None:
        """Also the parts' deferred non-finite checks; ``between``'s names its step as a training step."""
        super().check_deferred()
        for part in self._parts():
            unchecked = getattr(part, "_unchecked", None)
            if not unchecked:
                continue
            if part is self.between and self._period_length > 1:
                with self._naming_training_step(self.period.training_step(unchecked[0][0])):
                    part.check_deferred()
            else:
                part.check_deferred()

    def _before_start(self, step: int) -> None:
        """Called first in every ``start`` (default: nothing)."""

    def _start_step(self, step: int) -> PeriodStep:
        self._before_start(step)
        self._open = step
        if self.period.ends(step):
            return PeriodStep(step, at_period_end=self._start_period_end(step))
        parts = PeriodStep(step)
        if self.between is not None:
            self._between_before = self.between.state_snapshot()
            with self._naming_training_step(step):
                parts.between = self.between.start(self.period.between(step))
        return parts

    def progress(self, pending: PeriodStep, wait: bool = False) -> bool:
        """``between``'s progress on the steps it runs (PowerGossip's further power iterations during backward).

        A period end's exchange is posted whole in ``start``: on those steps there is nothing to progress.

        Args:
            pending: what :meth:`start` returned for the open step.
            wait: post everything that may be posted early, waiting as needed.

        Returns:
            Whether a later call may still make progress this step.
        """
        if pending.between is None or self.between is None:
            return False
        return self.between.progress(pending.between, wait)

    def _finish_step(self, pending: PeriodStep) -> None:
        if pending.between is not None and self.between is not None:
            with self._naming_training_step(pending.step):
                self.between.finish(pending.between)
        self._finish_step_end(pending)
        self._open, self._between_before = None, None

    def _between_state(self) -> dict[str, Any] | None:
        """``between``'s state from before the open step's start (or now, between steps); None without it."""
        if self.between is None:
            return None
        return self._between_before if self._between_before is not None else self.between.state_dict()

    @abc.abstractmethod
    def _start_period_end(self, step: int) -> Any:
        """Post what a period's last step sends (``start``'s part on such a step); return what finishing needs."""

    @abc.abstractmethod
    def _finish_step_end(self, pending: PeriodStep) -> None:
        """After ``between``'s finish on every step: complete what a period end posted, when it is due."""
