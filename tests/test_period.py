"""The calendar shared by PeriodicAverage and OuterOptimizer: period ends, and the steps between numbered gap-free."""

import pytest

from gossip.algorithms.period import Period


@pytest.mark.parametrize("length", [2, 3, 5, 10])
def test_steps_between_are_numbered_without_gaps_and_map_back(length):
    period = Period(length)
    steps = range(7 * length)
    between = [s for s in steps if not period.ends(s)]
    assert [period.between(s) for s in between] == list(range(len(between)))
    assert [period.training_step(period.between(s)) for s in between] == between


@pytest.mark.parametrize("length", [1, 4, 7])
def test_period_ends_every_length_steps_and_counts_them(length):
    period = Period(length)
    ends = [s for s in range(5 * length) if period.ends(s)]
    assert ends == [k * length + length - 1 for k in range(5)]
    assert [period.index(s) for s in ends] == list(range(5))
