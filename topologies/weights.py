"""Edge weightings that turn a graph into a mixing matrix (docs/design.md F.1).

Convention: in a DiGraph an edge u -> v means v receives x_u, i.e. W[v, u] > 0. An undirected edge
{u, v} is both u -> v and v -> u. Self loops in the input graph are ignored except by ``attribute``.

- ``uniform``:     W_ij = 1 / (d_i + 1) for each in-neighbour j of i and for j = i, with d_i the in-degree
                   of i. On a d-regular graph this is 1/(d+1) everywhere (PowerGossip's ``Ring`` is d = 2,
                   weight 1/3). On an irregular graph every row still sums to 1 (row-stochastic), but the
                   columns need not: the matrix is stochastic, not doubly stochastic, and the average drifts.
                   Use ``metropolis`` when the average must be preserved.
- ``metropolis``:  Metropolis-Hastings, undirected graphs only:
                   W_ij = 1 / (1 + max(d_i, d_j)) for each edge, W_ii = 1 - sum_{j != i} W_ij.
                   Symmetric and doubly stochastic for any undirected graph.
- ``attribute``:   W[v, u] = G[u][v][attr]; W_ii = the self loop's attribute if present, else
                   1 - sum_{j != i} W_ij. Validation then checks what the user gave.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from topologies.peer_view import Triplets
from topologies.schedule import ScheduleError

WEIGHTINGS = ("uniform", "metropolis", "attribute")


def check_node_labels(graph: nx.Graph) -> int:
    """The number of ranks n of ``graph``, after checking that its nodes are exactly the integers 0..n-1.

    Args:
        graph: a networkx Graph or DiGraph.

    Returns:
        n, the number of nodes.

    Raises:
        ScheduleError: ``graph`` is a multigraph, has no nodes, or has a node other than 0..n-1.
    """
    if graph.is_multigraph():
        raise ScheduleError("multigraphs are not supported: merge parallel edges first (nx.DiGraph(G) or nx.Graph(G))")
    n = graph.number_of_nodes()
    if n == 0:
        raise ScheduleError("the graph has no nodes; a schedule needs at least one rank")
    nodes = set(graph.nodes)
    if nodes != set(range(n)):
        strange = sorted(str(v) for v in nodes - set(range(n)))[:5]
        raise ScheduleError(
            f"graph nodes must be the ranks 0..{n - 1}; found {strange}; "
            "relabel with nx.convert_node_labels_to_integers(G)"
        )
    return n


def _directed_edges(graph: nx.Graph) -> list[tuple[int, int]]:
    """(u, v) pairs meaning v receives from u, without self loops."""
    edges = [(u, v) for u, v in graph.edges if u != v]
    if not graph.is_directed():
        edges += [(v, u) for u, v in edges]
    return edges


def uniform_weights(graph: nx.Graph) -> Triplets:
    """The ``uniform`` weighting: 1/(d_i + 1) to self and to each in-neighbour, d_i the in-degree of i.

    Row-stochastic; doubly stochastic only on a regular graph (see the module docstring).

    Args:
        graph: a graph on nodes 0..n-1 (self loops ignored).

    Returns:
        W in coordinate form (rows, cols, weights).

    Raises:
        ScheduleError: the nodes are not 0..n-1, or the graph is a multigraph.
    """
    n = check_node_labels(graph)
    edges = _directed_edges(graph)
    senders = np.array([u for u, _ in edges], dtype=np.int64)
    receivers = np.array([v for _, v in edges], dtype=np.int64)
    in_degree = np.bincount(receivers, minlength=n)
    ranks = np.arange(n)
    rows = np.concatenate([receivers, ranks])
    cols = np.concatenate([senders, ranks])
    return rows, cols, 1.0 / (in_degree[rows] + 1.0)


def metropolis_weights(graph: nx.Graph) -> Triplets:
    """Metropolis-Hastings weights W_ij = 1 / (1 + max(d_i, d_j)), W_ii = 1 - sum_{j != i} W_ij (docs/design.md F.1).

    Symmetric and doubly stochastic for any undirected graph.

    Args:
        graph: an undirected graph on nodes 0..n-1, or a DiGraph in which every edge has its reverse.

    Returns:
        W in coordinate form (rows, cols, weights).

    Raises:
        ScheduleError: a DiGraph edge has no reverse, the nodes are not 0..n-1, or the graph is a multigraph.
    """
    n = check_node_labels(graph)
    if graph.is_directed():
        one_way = [(u, v) for u, v in graph.edges if u != v and not graph.has_edge(v, u)]
        if one_way:
            raise ScheduleError(
                f"weights='metropolis' needs an undirected graph, but edge {one_way[0]} has no reverse; "
                "pass G.to_undirected() or use weights='uniform'"
            )
        graph = graph.to_undirected()
    undirected = nx.Graph(graph)
    undirected.remove_edges_from(list(nx.selfloop_edges(undirected)))
    degree = np.array([undirected.degree(i) for i in range(n)], dtype=np.float64)
    pairs = np.array(list(undirected.edges), dtype=np.int64).reshape(-1, 2)
    w = 1.0 / (1.0 + np.maximum(degree[pairs[:, 0]], degree[pairs[:, 1]]))
    self_weight = 1.0 - np.bincount(pairs.ravel(), weights=np.repeat(w, 2), minlength=n)
    ranks = np.arange(n)
    rows = np.concatenate([pairs[:, 0], pairs[:, 1], ranks])
    cols = np.concatenate([pairs[:, 1], pairs[:, 0], ranks])
    return rows, cols, np.concatenate([w, w, self_weight])


def attribute_weights(graph: nx.Graph, attr: str = "weight") -> Triplets:
    """Weights read from the edge attribute ``attr``: edge u -> v gives W[v, u].

    W_ii is the self loop's attribute when the graph has one, else 1 - sum_{j != i} W_ij. Nothing is checked
    here: validation of the schedule checks what the user gave.

    Args:
        graph: a graph on nodes 0..n-1 whose every edge carries ``attr``.
        attr: the name of the edge attribute.

    Returns:
        W in coordinate form (rows, cols, weights).

    Raises:
        ScheduleError: an edge lacks ``attr``, the nodes are not 0..n-1, or the graph is a multigraph.
    """
    n = check_node_labels(graph)
    rows, cols, vals = [], [], []
    self_given = {}
    for u, v, data in graph.edges(data=True):
        if attr not in data:
            raise ScheduleError(f"edge ({u}, {v}) has no '{attr}' attribute required by weights='attribute'")
        w = float(data[attr])
        if u == v:
            self_given[u] = w
            continue
        pairs = [(v, u)] if graph.is_directed() else [(v, u), (u, v)]
        for i, j in pairs:
            rows.append(i)
            cols.append(j)
            vals.append(w)
    off_sum = np.bincount(np.array(rows, dtype=np.int64), weights=np.array(vals), minlength=n)
    self_weight = [self_given.get(i, 1.0 - off_sum[i]) for i in range(n)]
    return np.array(rows + list(range(n))), np.array(cols + list(range(n))), np.array(vals + self_weight)


def graph_weights(graph: nx.Graph, weights: str, attr: str = "weight") -> Triplets:
    """The mixing weights of ``graph`` under the weighting named ``weights``.

    Args:
        graph: a graph on nodes 0..n-1.
        weights: one of WEIGHTINGS: ``"uniform"``, ``"metropolis"`` or ``"attribute"``.
        attr: the edge attribute read by ``"attribute"``.

    Returns:
        W in coordinate form (rows, cols, weights).

    Raises:
        ScheduleError: ``weights`` is unknown, or the weighting refuses the graph.
    """
    if weights == "uniform":
        return uniform_weights(graph)
    if weights == "metropolis":
        return metropolis_weights(graph)
    if weights == "attribute":
        return attribute_weights(graph, attr)
    raise ScheduleError(f"unknown weights={weights!r}; expected one of {WEIGHTINGS}")
