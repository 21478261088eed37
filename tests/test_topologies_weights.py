"""Edge weightings and graph inputs (docs/design.md F.1)."""

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topologies
from topologies import ScheduleError


def _connected_graph(n: int, p: float, seed: int) -> nx.Graph:
    graph = nx.gnp_random_graph(n, p, seed=seed)
    graph.add_edges_from((i, i + 1) for i in range(n - 1))  # a path keeps it connected
    return graph


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 24), p=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_metropolis_weights_are_symmetric_and_doubly_stochastic(n, p, seed):
    w = topologies.from_networkx(_connected_graph(n, p, seed), weights="metropolis").mixing_matrix(0)
    np.testing.assert_allclose(w, w.T, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert (w >= 0).all()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 24), p=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_metropolis_edge_weight_is_one_over_one_plus_larger_degree(n, p, seed):
    graph = _connected_graph(n, p, seed)
    w = topologies.from_networkx(graph, weights="metropolis").mixing_matrix(0)
    for i, j in graph.edges:
        assert w[i, j] == pytest.approx(1 / (1 + max(graph.degree(i), graph.degree(j))))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 24), p=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_uniform_weights_on_any_graph_are_row_stochastic_with_one_over_degree_plus_one(n, p, seed):
    graph = _connected_graph(n, p, seed)
    w = topologies.from_networkx(graph, weights="uniform").mixing_matrix(0)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    for i in range(n):
        assert w[i, i] == pytest.approx(1 / (graph.degree(i) + 1))


@pytest.mark.parametrize("degree", [2, 3, 5])
def test_uniform_weights_on_a_regular_graph_are_one_over_degree_plus_one(degree):
    w = topologies.random_regular(12, degree, seed=1).mixing_matrix(0)
    assert set(np.round(w[w > 0], 12)) == {round(1 / (degree + 1), 12)}


def test_hypercube_uniform_weights_are_one_over_log2_n_plus_one():
    w = topologies.hypercube(16).mixing_matrix(0)
    assert np.count_nonzero(w[5]) == 5 and w[5, 5 ^ 4] == pytest.approx(1 / 5)


def test_attribute_weights_are_read_from_the_edges():
    graph = nx.DiGraph()
    graph.add_weighted_edges_from([(0, 1, 0.25), (1, 2, 0.5), (2, 0, 0.75)])
    w = topologies.from_networkx(graph, weights="attribute").mixing_matrix(0)
    assert w[1, 0] == 0.25 and w[2, 1] == 0.5 and w[0, 2] == 0.75
    np.testing.assert_allclose(np.diag(w), [0.25, 0.75, 0.5])


def test_directed_graph_edge_u_to_v_means_v_receives_from_u():
    graph = nx.DiGraph([(0, 1), (1, 2), (2, 0)])
    view = topologies.from_networkx(graph, weights="uniform").peers(1, 0)
    assert view.in_peers == ((0, 0.5),) and view.out_peers == ((2, 0.5),)


def test_edge_list_file_with_weights(tmp_path):
    path = tmp_path / "triangle.txt"
    path.write_text("# u v w\n0 1 0.25\n1 2 0.25\n0 2 0.25\n")
    w = topologies.from_edge_list(path, weights="attribute").mixing_matrix(0)
    np.testing.assert_allclose(w, [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])


def test_edge_list_file_without_weights_uses_metropolis(tmp_path):
    path = tmp_path / "path.txt"
    path.write_text("0 1\n1 2\n")
    w = topologies.from_edge_list(path).mixing_matrix(0)
    assert w[0, 1] == pytest.approx(1 / 3) and w[0, 0] == pytest.approx(2 / 3)


def test_edge_list_with_explicit_n_adds_unlisted_ranks_and_then_fails_connectivity(tmp_path):
    path = tmp_path / "path.txt"
    path.write_text("0 1\n1 2\n")
    with pytest.raises(ScheduleError, match=r"'strongly-connected'.*\[3\]"):
        topologies.from_edge_list(path, n=4)


def test_edge_list_naming_a_rank_beyond_n_is_rejected(tmp_path):
    path = tmp_path / "path.txt"
    path.write_text("0 1\n1 5\n")
    with pytest.raises(ScheduleError, match=r"names rank 5, outside 0..3 \(n=4\)"):
        topologies.from_edge_list(path, n=4)


def test_graph_with_non_rank_labels_is_rejected():
    with pytest.raises(ScheduleError, match=r"nodes must be the ranks 0..1; found \['a', 'b'\]"):
        topologies.from_networkx(nx.Graph([("a", "b")]))


def test_metropolis_on_a_one_way_directed_graph_is_rejected():
    with pytest.raises(ScheduleError, match=r"'metropolis' needs an undirected graph, but edge \(0, 1\)"):
        topologies.from_networkx(nx.DiGraph([(0, 1), (1, 2), (2, 0)]), weights="metropolis")


def test_missing_weight_attribute_is_rejected_naming_the_edge():
    with pytest.raises(ScheduleError, match=r"edge \(0, 1\) has no 'weight' attribute"):
        topologies.from_networkx(nx.path_graph(3), weights="attribute")


def test_unknown_weighting_is_rejected():
    with pytest.raises(ScheduleError, match=r"unknown weights='max'"):
        topologies.ring(8, weights="max")
