r"""The phases of one training step of :class:`gossip.wrapper.parallel.DecentralizedDataParallel`, and its legal moves.

Step t of the wrapper (Decent-DP's schema, arXiv 2410.11998, Sec. 3) goes through

.. code-block:: text

    IDLE --start--> EXCHANGING --finish--> MIXED --advance--> IDLE (step t + 1) --start--> ...
     x_t in place    x_t sent, forward      x_i <- sum_j W_ij x_j    update applied,
                     and backward run       (the optimizer's         step_count = t + 1
                     meanwhile              update comes next)

``start`` is ``algorithm.start(t)`` (at the first forward of step t, or right after step t-1's update);
``finish`` is ``algorithm.finish`` (before the optimizer's update); ``advance`` ends the step after the update
(``next_step``). ``discard`` (restoring a checkpoint) drops whatever step was under way and leaves the restored
x_t in place; ``close`` retires the wrapper. Every change of phase goes through :meth:`StepState.move`, which
holds the only table of legal moves and raises :class:`StepPhaseError` for any other.
"""

from __future__ import annotations

import enum

from gossip.errors import StepPhaseError


class StepPhase(enum.Enum):
    """Where the wrapper is within the current step."""

    IDLE = "idle (x_t in place, no exchange in flight)"
    EXCHANGING = "exchanging (step t's exchange in flight)"
    MIXED = "mixed (the mixing is written, the optimizer's update comes next)"
    CLOSED = "closed"


_IDLE, _EXCHANGING, _MIXED, _CLOSED = StepPhase.IDLE, StepPhase.EXCHANGING, StepPhase.MIXED, StepPhase.CLOSED

#: event -> {phase it may happen in: phase it leads to}; nothing else is legal.
TRANSITIONS: dict[str, dict[StepPhase, StepPhase]] = {
    "start": {_IDLE: _EXCHANGING},
    "finish": {_EXCHANGING: _MIXED},
    "advance": {_MIXED: _IDLE},
    "discard": {_IDLE: _IDLE, _EXCHANGING: _IDLE, _MIXED: _IDLE},
    "close": {_IDLE: _CLOSED, _EXCHANGING: _CLOSED, _MIXED: _CLOSED},
}

#: What to do when an event comes at the wrong time (the events a user can trigger out of order).
_ADVICE = {
    "advance": "call finish_mixing() before the update and next_step() after it, once per step",
}


class StepState:
    """The current :class:`StepPhase` of one wrapper; :meth:`move` applies an event from :data:`TRANSITIONS`."""

    def __init__(self) -> None:
        self.phase = StepPhase.IDLE

    def move(self, event: str, where: str) -> StepPhase:
        """Apply ``event`` and return the new phase.

        Args:
            event: a step event of :data:`TRANSITIONS` (e.g. ``"advance"``).
            where: who and when, for the message, e.g. ``"rank 1: step 7: next_step()"``.

        Returns:
            The phase after the event.

        Raises:
            StepPhaseError: ``event`` is not legal in the current phase; the message names ``where``.
        """
        self.check(event, where)
        self.phase = TRANSITIONS[event][self.phase]
        return self.phase

    def check(self, event: str, where: str) -> None:
        """Refuse ``event`` unless it is legal now, without applying it.

        Call it before an action that cannot be undone, then :meth:`move` once the action succeeded.

        Args:
            event: a step event of :data:`TRANSITIONS`.
            where: who and when, for the message.

        Raises:
            StepPhaseError: ``event`` is not legal in the current phase.
        """
        legal = TRANSITIONS[event]
        if self.phase not in legal:
            allowed = " or ".join(phase.name for phase in legal)
            advice = _ADVICE.get(event, "this is a bug in the wrapper's step logic; please report it")
            raise StepPhaseError(
                f"{where}: '{event}' is not allowed while the step is {self.phase.value}; it is legal only when "
                f"{allowed}: {advice}"
            )

    @property
    def in_flight(self) -> bool:
        """Step t's exchange has been started and not yet completed."""
        return self.phase is StepPhase.EXCHANGING

    @property
    def mixed(self) -> bool:
        """Step t's mixing is written and the step has not advanced yet."""
        return self.phase is StepPhase.MIXED

    @property
    def closed(self) -> bool:
        """The wrapper was closed: every further move is refused."""
        return self.phase is StepPhase.CLOSED
