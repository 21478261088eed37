"""The schedule contract consumed by the gossip algorithms: peers, matrices, graphs, groups, fingerprints."""

import networkx as nx
import numpy as np
import pytest

import topologies
from topologies import PeerView, ScheduleError

BUILT_INS = [topologies.by_name(name, 16) for name in topologies.names()] + [
    topologies.random_matchings(9, seed=3),
    topologies.star(6, weights="uniform"),
    topologies.torus(3, 4),
    topologies.cyclic([topologies.ring(8), topologies.one_peer_hypercube(8), topologies.one_peer_ring(8)]),
    topologies.alternating_exp_ring(2, 3),
    topologies.hierarchical(1, 4),
]
IDS = [f"{s.name}-{s.n}" for s in BUILT_INS]


@pytest.mark.parametrize("schedule", BUILT_INS, ids=IDS)
def test_peers_agree_with_mixing_matrix_for_every_rank_and_step(schedule):
    for t in schedule.check_steps:
        w = schedule.mixing_matrix(t)
        for rank in range(schedule.n):
            view = schedule.peers(rank, t)
            assert view.self_weight == w[rank, rank]
            expected_in = tuple((j, w[rank, j]) for j in range(schedule.n) if j != rank and w[rank, j] > 0)
            expected_out = tuple((j, w[j, rank]) for j in range(schedule.n) if j != rank and w[j, rank] > 0)
            assert view.in_peers == expected_in
            assert view.out_peers == expected_out


@pytest.mark.parametrize("schedule", BUILT_INS, ids=IDS)
def test_out_peer_lists_mirror_in_peer_lists(schedule):
    for t in schedule.check_steps:
        views = [schedule.peers(r, t) for r in range(schedule.n)]
        for view in views:
            for j, weight in view.out_peers:
                assert (view.rank, weight) in views[j].in_peers


@pytest.mark.parametrize("schedule", BUILT_INS, ids=IDS)
def test_every_mixing_matrix_is_row_stochastic_and_non_negative(schedule):
    for t in schedule.check_steps:
        w = schedule.mixing_matrix(t)
        assert w.dtype == np.float64 and w.shape == (schedule.n, schedule.n)
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)


@pytest.mark.parametrize("schedule", BUILT_INS, ids=IDS)
def test_graph_edges_carry_the_receiving_weight(schedule):
    t = len(schedule.check_steps) - 1
    graph = schedule.graph(t)
    assert isinstance(graph, nx.DiGraph) and sorted(graph.nodes) == list(range(schedule.n))
    rebuilt = nx.to_numpy_array(graph, nodelist=range(schedule.n), weight="weight").T
    np.testing.assert_array_equal(rebuilt, schedule.mixing_matrix(t))


def test_periodic_schedule_repeats_after_its_period():
    schedule = topologies.one_peer_hypercube(16)
    for t in range(schedule.period):
        np.testing.assert_array_equal(schedule.mixing_matrix(t), schedule.mixing_matrix(t + 3 * schedule.period))


def test_peer_view_reports_the_requested_step():
    view = topologies.one_peer_hypercube(8).peers(3, 7)
    assert view == PeerView(rank=3, step=7, self_weight=0.5, in_peers=((1, 0.5),), out_peers=((1, 0.5),))


def test_one_peer_exponential_sends_forward_and_receives_backward():
    view = topologies.one_peer_exponential(8).peers(5, 2)
    assert view.in_peers == ((1, 0.5),) and view.out_peers == ((1, 0.5),)
    view = topologies.one_peer_exponential(8).peers(5, 1)
    assert view.in_peers == ((3, 0.5),) and view.out_peers == ((7, 0.5),)


def test_fingerprint_is_equal_for_equal_schedules():
    assert topologies.hierarchical(4, 2).fingerprint() == topologies.hierarchical(4, 2).fingerprint()


def test_fingerprint_differs_for_different_schedules():
    prints = {
        topologies.one_peer_hypercube(8).fingerprint(),
        topologies.one_peer_exponential(8).fingerprint(),
        topologies.random_matchings(8, seed=0).fingerprint(),
        topologies.random_matchings(8, seed=1).fingerprint(),
        topologies.ring(8).fingerprint(),
        topologies.ring(9).fingerprint(),
    }
    assert len(prints) == 6


def test_random_matchings_are_identical_across_independent_constructions():
    a, b = topologies.random_matchings(16, seed=7), topologies.random_matchings(16, seed=7)
    for t in (0, 1, 2, 1000, 123_456):
        np.testing.assert_array_equal(a.mixing_matrix(t), b.mixing_matrix(t))
    assert a.fingerprint() == b.fingerprint()


def test_random_matchings_differ_between_steps():
    schedule = topologies.random_matchings(16, seed=0)
    assert not np.array_equal(schedule.mixing_matrix(0), schedule.mixing_matrix(1))


def test_random_matchings_with_odd_n_leave_exactly_one_rank_alone():
    schedule = topologies.random_matchings(9, seed=0)
    for t in range(20):
        sizes = sorted(len(g) for g in schedule.groups(t))
        assert sizes == [1, 2, 2, 2, 2]


@pytest.mark.parametrize(
    "schedule",
    [
        topologies.one_peer_hypercube(8),
        topologies.random_matchings(8),
        topologies.one_peer_ring(8),
        topologies.alternating_exp_ring(4, 2),
        topologies.hierarchical(4, 2),
    ],
    ids=lambda s: s.name,
)
def test_group_schedules_partition_the_ranks_every_step(schedule):
    for t in schedule.check_steps:
        members = sorted(r for group in schedule.groups(t) for r in group)
        assert members == list(range(schedule.n))


def test_groups_is_none_for_a_step_that_is_not_exact_group_averaging():
    assert topologies.ring(8).groups(0) is None
    assert topologies.one_peer_exponential(8).groups(0) is None


def test_symmetry_and_double_stochasticity_flags():
    assert topologies.one_peer_hypercube(8).is_symmetric
    assert not topologies.one_peer_exponential(8).is_symmetric
    assert topologies.static_exponential(8).is_doubly_stochastic
    assert not topologies.star(6, weights="uniform").is_doubly_stochastic


def test_cyclic_uses_each_item_in_turn_with_its_own_counter():
    cube = topologies.one_peer_hypercube(8)
    schedule = topologies.cyclic([topologies.ring(8), cube])
    assert schedule.period == 2 * 3
    np.testing.assert_array_equal(schedule.mixing_matrix(0), topologies.ring(8).mixing_matrix(0))
    for local in range(3):
        np.testing.assert_array_equal(schedule.mixing_matrix(2 * local + 1), cube.mixing_matrix(local))


def test_negative_step_is_rejected_naming_the_step():
    with pytest.raises(ScheduleError, match=r"step t=-1 is negative"):
        topologies.ring(8).peers(0, -1)


def test_non_integer_step_is_rejected():
    with pytest.raises(ScheduleError, match=r"step must be an integer, got 1.5"):
        topologies.ring(8).mixing_matrix(1.5)


def test_steps_and_ranks_may_be_any_integral_but_bool():
    schedule = topologies.one_peer_hypercube(8)
    assert schedule.peers(np.int64(3), np.int32(5)) == schedule.peers(3, 5)
    with pytest.raises(ScheduleError, match=r"step must be an integer, got True"):
        schedule.peers(0, True)
    with pytest.raises(ScheduleError, match=r"rank True is out of range"):
        schedule.peers(True, 0)


def test_rank_out_of_range_is_rejected_naming_the_rank():
    with pytest.raises(ScheduleError, match=r"rank 8 is out of range .* n=8 \(valid: 0..7\)"):
        topologies.one_peer_hypercube(8).peers(8, 0)


def test_negative_rank_is_rejected():
    with pytest.raises(ScheduleError, match=r"rank -1 is out of range"):
        topologies.ring(8).peers(-1, 0)


def test_wrong_world_size_is_rejected_naming_both_sizes():
    with pytest.raises(ScheduleError, match=r"built for n=8 ranks but the world has 16"):
        topologies.ring(8).require_size(16)
