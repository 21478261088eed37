"""Static mixing graphs (period 1), built on networkx generators.

Each function returns a validated :class:`Schedule`. ``weights`` is one of ``"uniform"``,
``"metropolis"`` or ``"attribute"`` (see :mod:`topologies.weights`); on a regular graph uniform and
Metropolis-Hastings coincide (1/(d+1), docs/design.md F.1).

>>> ring(8).mixing_matrix(0)[0, :3]
array([0.33333333, 0.33333333, 0.        ])
"""

from __future__ import annotations

import math
import os

import networkx as nx
import numpy as np

from topologies.arguments import integer
from topologies.peer_view import Triplets
from topologies.schedule import Schedule, ScheduleError, dense_to_triplets
from topologies.weights import check_node_labels, graph_weights


def _static(n: int, name: str, triplets: Triplets, params: dict) -> Schedule:
    frozen = tuple(np.asarray(a).copy() for a in triplets)
    return Schedule(n, name, lambda phase: frozen, period=1, params=params)


def from_networkx(graph: nx.Graph, weights: str = "metropolis", *, attr: str = "weight", name: str = "") -> Schedule:
    """A static schedule from a user graph on nodes 0..n-1 (DiGraph edge u -> v: v receives x_u).

    Args:
        graph: a networkx Graph or DiGraph whose nodes are exactly 0..n-1.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).
        attr: the edge attribute read by ``weights="attribute"``.
        name: the schedule's name; empty gives ``"from_networkx"``.

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: the nodes are not 0..n-1, the graph is a multigraph, the weighting is unknown or does not
            apply to the graph, or the result fails validation (e.g. a disconnected graph).
    """
    return _from_graph(graph, weights, name or "from_networkx", attr=attr, weights=weights)


def _from_graph(graph: nx.Graph, weighting: str, name: str, *, attr: str = "weight", **params) -> Schedule:
    n = check_node_labels(graph)
    return _static(n, name, graph_weights(graph, weighting, attr), params)


def from_edge_list(
    path: str | os.PathLike, n: int | None = None, weights: str = "metropolis", *, directed: bool = False
) -> Schedule:
    """A static schedule from a text file of lines ``u v [weight]`` (``#`` starts a comment).

    ``n`` defaults to the largest rank named + 1; ranks that appear in no edge are still ranks (and then
    fail the connectivity check).

    Args:
        path: the edge-list file.
        n: the number of ranks; None takes the largest rank named + 1.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).
        directed: read each line ``u v`` as the one edge u -> v (v receives x_u) instead of both directions.

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: a line cannot be parsed, a rank lies outside 0..n-1, or the graph fails as in
            :func:`from_networkx`.
    """
    graph_type = nx.DiGraph if directed else nx.Graph
    try:
        graph = nx.read_edgelist(path, nodetype=int, create_using=graph_type, data=(("weight", float),))
    except (TypeError, ValueError, IndexError) as err:
        raise ScheduleError(f"cannot parse edge list {os.fspath(path)!r}: {err}") from err
    largest = max(graph.nodes, default=-1)
    n = integer("n", largest + 1 if n is None else n, 1)
    if largest >= n or min(graph.nodes, default=0) < 0:
        raise ScheduleError(f"edge list {os.fspath(path)!r} names rank {largest}, outside 0..{n - 1} (n={n})")
    graph.add_nodes_from(range(n))
    return from_networkx(graph, weights, name=f"edge_list:{os.path.basename(path)}")


def from_matrix(matrix: np.ndarray, name: str = "from_matrix") -> Schedule:
    """A static schedule from an explicit n x n mixing matrix.

    Args:
        matrix: W, of shape (n, n); W[i, j] is the weight rank i gives to x_j.
        name: the schedule's name.

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``matrix`` is not square, or it fails validation (negative, not row-stochastic, or not
            strongly connected).
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ScheduleError(f"a mixing matrix must be square (n, n), got shape {matrix.shape}")
    return _static(matrix.shape[0], name, dense_to_triplets(matrix), {})


def ring(n: int, weights: str = "uniform") -> Schedule:
    """The cycle 0-1-...-(n-1)-0, uniform weights 1/3 (PowerGossip's ``Ring``); n = 2 gives 1/2, n = 1 gives 1.

    Args:
        n: the number of ranks, >= 1.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``n`` is not an integer >= 1, or ``weights`` is unknown.
    """
    n = integer("n", n, 1)
    return _from_graph(nx.cycle_graph(n), weights, "ring", n=n, weights=weights)


def torus(rows: int, cols: int, weights: str = "uniform") -> Schedule:
    """The 2-D periodic grid of rows x cols ranks, rank = row * cols + col.

    Degree 4 when rows, cols >= 3; a side of 2 contributes one neighbour (the two directions being the same rank),
    a side of 1 none.

    Args:
        rows: the number of rows, >= 1.
        cols: the number of columns, >= 1.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``rows`` or ``cols`` is not an integer >= 1, or ``weights`` is unknown.
    """
    rows, cols = integer("rows", rows, 1), integer("cols", cols, 1)
    grid = nx.grid_2d_graph(rows, cols, periodic=True)
    graph = nx.relabel_nodes(grid, {(r, c): r * cols + c for r, c in grid.nodes})
    return _from_graph(graph, weights, "torus", rows=rows, cols=cols, weights=weights)


def complete(n: int) -> Schedule:
    """Everyone averages with everyone: W = (1/n) 1 1^T (exact all-reduce average).

    Built as its n^2 entries directly: the uniform weighting of the complete graph, 1/((n - 1) + 1) everywhere,
    the same floats as ``from_networkx(nx.complete_graph(n), "uniform")`` without building that graph.

    Args:
        n: the number of ranks, >= 1.

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``n`` is not an integer >= 1.
    """
    n = integer("n", n, 1)
    ranks = np.arange(n)
    return _static(n, "complete", (np.repeat(ranks, n), np.tile(ranks, n), np.full(n * n, 1.0 / n)), {"n": n})


def star(n: int, weights: str = "metropolis") -> Schedule:
    """Rank 0 connected to ranks 1..n-1 (irregular: Metropolis by default keeps it doubly stochastic).

    Args:
        n: the number of ranks, >= 1.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``n`` is not an integer >= 1, or ``weights`` is unknown.
    """
    n = integer("n", n, 1)
    return _from_graph(nx.star_graph(n - 1), weights, "star", n=n, weights=weights)


def static_exponential(n: int) -> Schedule:
    """Ying et al. static exponential graph (docs/design.md F.2).

    Rank i receives from every j with (i - j) mod n in {1, 2, 4, ..., 2^(tau-1)}, tau = ceil(log2 n), and
    gives weight 1/(tau + 1) to itself and each of them: directed, circulant, doubly stochastic for any n.
    For n = 2^K, rho = ||W - J||_2 = 1 - 2/(1 + log2 n).

    Args:
        n: the number of ranks, >= 1.

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``n`` is not an integer >= 1.
    """
    n = integer("n", n, 1)
    tau = math.ceil(math.log2(n)) if n > 1 else 0
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from(((i - 2**k) % n, i) for i in range(n) for k in range(tau))
    return _from_graph(graph, "uniform", "static_exponential", n=n)


def hypercube(n: int, weights: str = "uniform") -> Schedule:
    """The log2(n)-dimensional hypercube, i ~ i XOR 2^k; uniform weights 1/(log2 n + 1).

    Args:
        n: the number of ranks, a power of two.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``n`` is not a power of two, or ``weights`` is unknown.
    """
    n = integer("n", n, 1)
    if n & (n - 1):
        raise ScheduleError(f"hypercube needs n to be a power of two, got n={n}; use random_regular(n, degree)")
    # Built from the definition, not nx.hypercube_graph: its node labels are bit tuples for K >= 2 but plain ints
    # for K = 1 (and () for K = 0), which made hypercube(2) fail.
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from((i, i ^ (1 << k)) for i in range(n) for k in range(n.bit_length() - 1) if not i & (1 << k))
    return _from_graph(graph, weights, "hypercube", n=n, weights=weights)


def random_regular(n: int, degree: int, seed: int = 0, weights: str = "uniform") -> Schedule:
    """A seeded random ``degree``-regular graph (``nx.random_regular_graph``).

    Args:
        n: the number of ranks, >= 1.
        degree: the degree of every rank, in 0..n-1 with n * degree even.
        seed: the seed of the draw.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: networkx refuses (n, degree), e.g. an odd n * degree; or the drawn graph is disconnected.
    """
    n, degree, seed = integer("n", n, 1), integer("degree", degree, 0), integer("seed", seed)
    try:
        graph = nx.random_regular_graph(degree, n, seed=seed)
    except nx.NetworkXError as err:
        raise ScheduleError(f"random_regular(n={n}, degree={degree}): {err}") from err
    return _from_graph(graph, weights, "random_regular", n=n, degree=degree, seed=seed, weights=weights)


def erdos_renyi(n: int, p: float, seed: int = 0, weights: str = "metropolis") -> Schedule:
    """A seeded G(n, p) graph; a disconnected draw is refused (try another seed or a larger p).

    Args:
        n: the number of ranks, >= 1.
        p: the probability of each edge, in [0, 1].
        seed: the seed of the draw.
        weights: the edge weighting, ``"uniform"``, ``"metropolis"`` or ``"attribute"`` (:mod:`topologies.weights`).

    Returns:
        The validated static schedule (period 1).

    Raises:
        ScheduleError: ``p`` is not in [0, 1], or the drawn graph is disconnected.
    """
    n, seed = integer("n", n, 1), integer("seed", seed)
    if not 0.0 <= p <= 1.0:
        raise ScheduleError(f"erdos_renyi edge probability must be in [0, 1], got p={p}")
    graph = nx.erdos_renyi_graph(n, p, seed=seed)
    if not nx.is_connected(graph):
        raise ScheduleError(
            f"erdos_renyi(n={n}, p={p}, seed={seed}) drew a graph with "
            f"{nx.number_connected_components(graph)} components (property 'strongly-connected'); "
            "use another seed or a larger p"
        )
    return _from_graph(graph, weights, "erdos_renyi", n=n, p=p, seed=seed, weights=weights)
