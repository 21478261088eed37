"""Base-(k+1) graphs (topologies/finite_time.py): exact average after one period for any n, at most k peers a step."""

from __future__ import annotations

import numpy as np
import pytest

import topologies
from topologies.finite_time import base_graph_rounds


def _period_product(schedule: topologies.Schedule, start: int = 0) -> np.ndarray:
    product = np.eye(schedule.n)
    for t in range(start, start + schedule.period):
        product = schedule.mixing_matrix(t) @ product
    return product


@pytest.mark.parametrize("max_degree", [1, 2, 3])
@pytest.mark.parametrize("n", [*range(1, 41), 96])
def test_one_period_multiplies_to_the_exact_average(n: int, max_degree: int) -> None:
    schedule = topologies.base_graph(n, max_degree)
    np.testing.assert_allclose(_period_product(schedule), np.full((n, n), 1.0 / n), rtol=0, atol=1e-12)


@pytest.mark.parametrize("max_degree", [1, 2, 3])
@pytest.mark.parametrize("n", [5, 6, 7, 12, 13, 24, 31, 96])
def test_no_rank_has_more_than_max_degree_peers_in_a_step(n: int, max_degree: int) -> None:
    schedule = topologies.base_graph(n, max_degree)
    for t in range(schedule.period):
        view_sizes = [len(schedule.peers(rank, t).in_peers) for rank in range(n)]
        assert max(view_sizes) <= max_degree, (t, view_sizes)


@pytest.mark.parametrize("n", [6, 12, 24, 96])
def test_every_step_is_symmetric_and_doubly_stochastic(n: int) -> None:
    schedule = topologies.base_graph(n)
    assert schedule.is_symmetric and schedule.is_doubly_stochastic
    for t in range(schedule.period):
        w = schedule.mixing_matrix(t)
        assert (w >= 0).all()


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_a_power_of_two_with_one_peer_is_the_one_peer_hypercube(n: int) -> None:
    base, hypercube = topologies.base_graph(n), topologies.one_peer_hypercube(n)
    assert base.period == hypercube.period
    for t in range(base.period):
        np.testing.assert_array_equal(base.mixing_matrix(t), hypercube.mixing_matrix(t))


@pytest.mark.parametrize(("n", "period"), [(3, 3), (5, 5), (6, 4), (12, 5), (24, 6), (96, 8), (1000, 16), (1024, 10)])
def test_periods_of_one_peer_base_graphs(n: int, period: int) -> None:
    # one peer: 2 floor(log2 m) + 1 steps for the odd part m, plus log2 of the power of two
    assert len(base_graph_rounds(n)) == period


def test_with_more_peers_the_period_shrinks() -> None:
    periods = [topologies.base_graph(26, k).period for k in (1, 2, 3)]
    assert periods == sorted(periods, reverse=True) and periods[0] > periods[-1]


def test_one_rank_is_a_single_step_of_weight_one() -> None:
    schedule = topologies.base_graph(1)
    assert schedule.period == 1 and schedule.mixing_matrix(0).tolist() == [[1.0]]


def test_exact_averaging_starts_names_the_first_phase_of_a_base_graph() -> None:
    starts = topologies.exact_averaging_starts(topologies.base_graph(6))
    assert starts[0] == 4
    for phase, steps in starts.items():
        product = np.eye(6)
        for t in range(phase, phase + steps):
            product = topologies.base_graph(6).mixing_matrix(t) @ product
        np.testing.assert_allclose(product, np.full((6, 6), 1 / 6), atol=1e-12)


def test_exact_averaging_starts_every_phase_of_the_hypercube_and_none_of_the_ring() -> None:
    assert topologies.exact_averaging_starts(topologies.one_peer_hypercube(8)) == {0: 3, 1: 3, 2: 3}
    assert topologies.exact_averaging_starts(topologies.ring(8)) == {}
    assert topologies.exact_averaging_starts(topologies.random_matchings(8)) == {}


def test_registry_builds_it_with_its_option() -> None:
    schedule = topologies.by_name("base_graph", 12, max_degree=2)
    assert schedule.params == {"n": 12, "max_degree": 2}
    assert topologies.by_name("base_graph", 12).period == 5


@pytest.mark.parametrize(("n", "max_degree"), [(0, 1), (6, 0), (True, 1), (6, 1.5)])
def test_bad_arguments_are_refused_by_name(n: object, max_degree: object) -> None:
    with pytest.raises(topologies.ScheduleError, match=r"n|max_degree"):
        topologies.base_graph(n, max_degree)  # type: ignore[arg-type]
