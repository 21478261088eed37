"""Numbers shown by ``python -m topologies describe`` and ``compare``, computed in one place."""

from __future__ import annotations

from dataclasses import dataclass

from topologies import analysis
from topologies.registry import by_name, names
from topologies.schedule import Schedule, ScheduleError

CONSENSUS_TOL = 1e-6


@dataclass(frozen=True)
class ScheduleSummary:
    """What ``python -m topologies describe`` and ``compare`` show of one schedule.

    Attributes:
        name: the schedule's name.
        n: the number of ranks.
        period: the period, or None when aperiodic.
        steps_checked: the number of steps the properties are checked over (``len(schedule.check_steps)``).
        min_in_degree: the smallest number of in-peers of a rank over those steps.
        max_in_degree: the largest number of in-peers of a rank over those steps.
        symmetric: whether every W(t) over those steps is symmetric.
        doubly_stochastic: whether every W(t) over those steps is doubly stochastic.
        step_rhos: rho = ||W(t) - J||_2 per step.
        step_gaps: the spectral gap 1 - |lambda_2(W(t))| per step.
        period_rho: ||Pi - J||_2 for the product Pi over those steps.
        steps_to_consensus: the worst-case steps to the tolerance, or None when not reached.
        noise_floor: the consensus distance a unit noise per rank and step sustains
            (:func:`topologies.analysis.noise_floor`).
    """

    name: str
    n: int
    period: int | None
    steps_checked: int
    min_in_degree: int
    max_in_degree: int
    symmetric: bool
    doubly_stochastic: bool
    step_rhos: tuple[float, ...]
    step_gaps: tuple[float, ...]
    period_rho: float
    steps_to_consensus: int | None
    noise_floor: float

    @property
    def period_label(self) -> str:
        """The period as shown: the number, or ``none (<steps_checked> checked)`` when aperiodic."""
        return str(self.period) if self.period is not None else f"none ({self.steps_checked} checked)"


def summarize(schedule: Schedule, tol: float = CONSENSUS_TOL) -> ScheduleSummary:
    """The period, in-degree range, flags, rho and gap per step, rho per period, steps to consensus, noise floor.

    rho = ||W - J||_2 (:func:`topologies.analysis.rho`), gap = 1 - |lambda_2(W)|
    (:func:`topologies.analysis.spectral_gap`), each for every step of ``schedule.check_steps``.

    Args:
        schedule: the schedule to summarise.
        tol: the tolerance of :func:`topologies.analysis.steps_to_consensus`, in (0, 1).

    Returns:
        The summary.

    Raises:
        ScheduleError: ``tol`` is not in (0, 1).
    """
    degrees = [len(schedule.peers(r, t).in_peers) for t in schedule.check_steps for r in range(schedule.n)]
    return ScheduleSummary(
        name=schedule.name,
        n=schedule.n,
        period=schedule.period,
        steps_checked=len(schedule.check_steps),
        min_in_degree=min(degrees),
        max_in_degree=max(degrees),
        symmetric=schedule.is_symmetric,
        doubly_stochastic=schedule.is_doubly_stochastic,
        step_rhos=tuple(float(r) for r in analysis.step_rhos(schedule)),
        step_gaps=tuple(float(g) for g in analysis.step_gaps(schedule)),
        period_rho=analysis.period_rho(schedule),
        steps_to_consensus=analysis.steps_to_consensus(schedule, tol),
        noise_floor=analysis.noise_floor(schedule),
    )


def compare(n: int, tol: float = CONSENSUS_TOL) -> tuple[list[ScheduleSummary], list[tuple[str, str]]]:
    """Summaries of every built-in schedule that can be built for n ranks.

    Args:
        n: the number of ranks.
        tol: the tolerance of :func:`topologies.analysis.steps_to_consensus`, in (0, 1).

    Returns:
        The summaries of the schedules built, in registry order, and (name, reason) for those that cannot be
            built for n.

    Raises:
        ScheduleError: ``tol`` is not in (0, 1).
    """
    built, skipped = [], []
    for name in names():
        try:
            schedule = by_name(name, n)
        except ScheduleError as err:
            skipped.append((name, str(err)))
            continue
        built.append(summarize(schedule, tol))
    return built, skipped
