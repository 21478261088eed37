"""Building and validating a schedule does O(edges) work (issue 31: complete(1024) took a minute).

The cost was the peer-consistency check: for every out-peer entry it scanned the other rank's in-peer tuple, so
sum over entries of the degree, cubic in n for the complete graph. Here every peer entry counts the equality
comparisons and hashes made on it: validation may touch each entry a bounded number of times, never once per
other entry of the same rank. (Wall time lives in benchmarks/topology_build.py.)
"""

import networkx as nx
import numpy as np
import pytest

import topologies
from topologies import PeerView, Schedule
from topologies.validation import find_violation

COUNT = {"ops": 0}


class _Entry(tuple):
    """An in/out-peer pair (j, w) that counts how often it is compared or hashed."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        COUNT["ops"] += 1
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        COUNT["ops"] += 1
        return tuple.__ne__(self, other)

    def __hash__(self) -> int:
        COUNT["ops"] += 1
        return tuple.__hash__(self)


class _Counted(Schedule):
    def peers(self, rank: int, t: int) -> PeerView:
        view = super().peers(rank, t)
        wrap = lambda pairs: tuple(_Entry(p) for p in pairs)  # noqa: E731
        return PeerView(view.rank, view.step, view.self_weight, wrap(view.in_peers), wrap(view.out_peers))


@pytest.mark.parametrize("n", [16, 64])
def test_peer_consistency_touches_each_peer_entry_a_bounded_number_of_times(n):
    rows, cols, weights = topologies.complete(n).triplets(0)
    COUNT["ops"] = 0
    _Counted(n, "complete", lambda phase: (rows, cols, weights), 1, symmetric=True, doubly_stochastic=True)
    entries = 2 * n * (n - 1)  # in- and out-peer entries of one step
    assert COUNT["ops"] <= 2 * entries


def test_complete_1024_builds_and_validates_as_the_exact_average():
    schedule = topologies.complete(1024)
    schedule.validate(symmetric=True, doubly_stochastic=True)
    rows, cols, weights = schedule.triplets(0)
    np.testing.assert_array_equal(rows * 1024 + cols, np.arange(1024**2))
    assert np.all(weights == 1 / 1024)
    assert schedule.is_symmetric and schedule.is_doubly_stochastic
    view = schedule.peers(1023, 0)
    assert len(view.in_peers) == len(view.out_peers) == 1023 and view.self_weight == 1 / 1024


@pytest.mark.parametrize("seed", range(40))
def test_strong_connectivity_check_agrees_with_networkx_on_random_directed_graphs(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    adjacency = rng.random((n, n)) < rng.uniform(0.05, 0.4)
    np.fill_diagonal(adjacency, False)
    rows, cols = np.nonzero(adjacency)
    triplets = (np.concatenate([rows, np.arange(n)]), np.concatenate([cols, np.arange(n)]), np.ones(rows.size + n))
    schedule = Schedule(n, "random", lambda phase: triplets, 1, validate=False)
    graph = nx.DiGraph(list(zip(cols.tolist(), rows.tolist(), strict=True)))  # j -> i: i receives from j
    graph.add_nodes_from(range(n))
    connected = find_violation(schedule, "strongly-connected") is None
    assert connected == nx.is_strongly_connected(graph)
