"""Every invalid input is refused at construction with a ScheduleError naming step, rank(s) and property."""

import dataclasses

import networkx as nx
import numpy as np
import pytest

import topologies
from topologies import Schedule, ScheduleError


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_negative_weight_names_step_rank_and_property():
    w = np.array([[1.2, -0.2], [0.5, 0.5]])
    with pytest.raises(ScheduleError, match=r"'non-negative' at step 0: rank 0 gives weight -0.2 to rank 1"):
        topologies.from_matrix(w)


def test_row_not_summing_to_one_names_step_ranks_and_property():
    w = np.array([[0.5, 0.5, 0.0], [0.5, 0.4, 0.0], [0.0, 0.5, 0.5]])
    with pytest.raises(ScheduleError, match=r"'row-stochastic' at step 0, rank\(s\) \[1\]: row sums 0.9"):
        topologies.from_matrix(w)


def test_bad_matrix_in_a_cycle_names_its_step():
    good = topologies.one_peer_hypercube(4).mixing_matrix(0)
    bad = good * 1.1
    with pytest.raises(ScheduleError, match=r"'row-stochastic' at step 1, rank\(s\) \[0, 1, 2, 3\]"):
        topologies.cyclic([good, bad], name="user")


def test_missing_column_stochasticity_names_the_ranks_when_required():
    star = topologies.star(5, weights="uniform")
    with pytest.raises(ScheduleError, match=r"'column-stochastic' at step 0, rank\(s\) \[0, 1, 2, 3, 4\]"):
        star.validate(doubly_stochastic=True)


def test_missing_symmetry_names_the_step_and_rank_pair_when_required():
    with pytest.raises(ScheduleError, match=r"'symmetric' at step 0, ranks \(0, 7\)"):
        topologies.one_peer_exponential(8).validate(symmetric=True)


def test_asymmetric_weights_on_a_symmetric_pattern_are_named():
    w = np.array([[0.6, 0.4], [0.2, 0.8]])
    schedule = topologies.from_matrix(w)
    with pytest.raises(
        ScheduleError, match=r"'symmetric' at step 0, ranks \(0, 1\): W\[0,1\] = 0.4 but W\[1,0\] = 0.2"
    ):
        schedule.validate(symmetric=True)


def test_disconnected_union_graph_names_the_components():
    graph = nx.Graph([(0, 1), (2, 3)])
    with pytest.raises(ScheduleError, match=r"'strongly-connected' over steps 0..0: 2 components: \[0, 1\]; \[2, 3\]"):
        topologies.from_networkx(graph)


def test_directed_graph_that_is_only_weakly_connected_is_rejected():
    with pytest.raises(ScheduleError, match=r"'strongly-connected'"):
        topologies.from_networkx(nx.DiGraph([(0, 1), (1, 2)]), weights="uniform")


def test_union_over_a_period_may_be_connected_when_no_single_step_is():
    halves = [topologies.one_peer_hypercube(4).mixing_matrix(t) for t in range(2)]
    assert topologies.cyclic(halves).period == 2


class _BrokenPeers(Schedule):
    def peers(self, rank, t):
        view = super().peers(rank, t)
        return dataclasses.replace(view, out_peers=()) if rank == 2 else view


def test_peers_disagreeing_between_ranks_is_rejected_naming_both_ranks():
    triplets = topologies.ring(4).triplets(0)
    with pytest.raises(ScheduleError, match=r"'peer-consistency' at step 0, ranks \(1, 2\)"):
        _BrokenPeers(4, "broken", lambda phase: triplets, period=1)


@pytest.mark.parametrize(
    "build",
    [topologies.hypercube, topologies.one_peer_hypercube, topologies.one_peer_exponential],
    ids=lambda f: f.__name__,
)
def test_n_not_a_power_of_two_is_rejected(build):
    with pytest.raises(ScheduleError, match=r"power of two.*n=12"):
        build(12)


def test_odd_n_for_one_peer_ring_is_rejected():
    with pytest.raises(ScheduleError, match=r"one_peer_ring needs an even n >= 2, got n=7"):
        topologies.one_peer_ring(7)


def test_alternating_exp_ring_with_nodes_not_a_power_of_two_is_rejected():
    with pytest.raises(ScheduleError, match=r"alternating_exp_ring needs nodes to be a power of two >= 2, got nodes=3"):
        topologies.alternating_exp_ring(3, 2)


def test_alternating_exp_ring_with_one_node_is_rejected():
    with pytest.raises(ScheduleError, match=r"got nodes=1"):
        topologies.alternating_exp_ring(1, 4)


def test_alternating_exp_ring_with_one_rank_per_node_is_rejected():
    with pytest.raises(ScheduleError, match=r"per_node >= 2, got per_node=1; .*one_peer_hypercube"):
        topologies.alternating_exp_ring(4, 1)


def test_hierarchical_with_nodes_not_a_power_of_two_is_rejected():
    with pytest.raises(ScheduleError, match=r"hierarchical needs nodes to be a power of two >= 1, got nodes=6"):
        topologies.hierarchical(6, 2)


def test_per_node_not_dividing_n_is_rejected():
    with pytest.raises(ScheduleError, match=r"per_node=3 does not divide n=16"):
        topologies.by_name("hierarchical", 16, per_node=3)


def test_non_positive_n_is_rejected():
    with pytest.raises(ScheduleError, match=r"n must be an integer >= 1, got n=0"):
        topologies.ring(0)


def test_random_regular_with_odd_n_times_degree_is_rejected():
    with pytest.raises(ScheduleError, match=r"random_regular\(n=7, degree=3\)"):
        topologies.random_regular(7, 3)


def test_disconnected_erdos_renyi_draw_is_rejected_naming_seed():
    with pytest.raises(ScheduleError, match=r"erdos_renyi\(n=16, p=0.05, seed=0\).*'strongly-connected'"):
        topologies.erdos_renyi(16, 0.05)


def test_random_matchings_with_one_rank_is_rejected():
    with pytest.raises(ScheduleError, match=r"random_matchings needs n >= 2"):
        topologies.random_matchings(1)


def test_random_matchings_with_negative_seed_is_rejected():
    with pytest.raises(ScheduleError, match=r"non-negative integer seed, got seed=-1"):
        topologies.random_matchings(8, seed=-1)


def test_cyclic_items_of_different_sizes_are_rejected():
    with pytest.raises(ScheduleError, match=r"cyclic item 1 \('ring'\) has n=6 but item 0 has n=8"):
        topologies.cyclic([topologies.ring(8), topologies.ring(6)])


def test_non_square_matrix_is_rejected():
    with pytest.raises(ScheduleError, match=r"must be square \(n, n\), got shape \(2, 3\)"):
        topologies.from_matrix(np.ones((2, 3)) / 3)


def test_unknown_schedule_name_lists_the_choices():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'mesh'; choose one of ring, torus"):
        topologies.by_name("mesh", 8)


def test_unknown_registry_option_is_rejected():
    with pytest.raises(ScheduleError, match=r"'ring' takes no option\(s\) \['seed'\]"):
        topologies.by_name("ring", 8, seed=1)


def test_powergossip_volume_on_a_directed_schedule_is_rejected():
    with pytest.raises(ScheduleError, match=r"not symmetric \(property 'symmetric'\)"):
        topologies.bytes_per_step(topologies.one_peer_exponential(8), [(4, 4)], "powergossip")


def test_unknown_algorithm_for_volume_is_rejected():
    with pytest.raises(ScheduleError, match=r"unknown algorithm='adam'"):
        topologies.bytes_per_step(topologies.ring(8), [(4, 4)], "adam")


def test_overrelaxation_of_a_time_varying_schedule_is_rejected():
    with pytest.raises(ScheduleError, match=r"time-varying \(period=3\)"):
        topologies.optimal_overrelaxation(topologies.one_peer_hypercube(8))
