"""Time-varying schedules (docs/design.md F.2, B.2, E.2).

Ranks are numbered node-major: rank = node * per_node + local_rank. Every schedule here is a pure function
of the step t. Where a schedule's usual definition needs n = 2^K (or even n, or per_node >= 2) it raises
:class:`ScheduleError` at construction naming the constraint; the only generalisation is documented in
:func:`random_matchings` (odd n).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx
import numpy as np

from topologies.arguments import integer
from topologies.peer_view import Triplets
from topologies.schedule import DEFAULT_APERIODIC_WINDOW, Schedule, ScheduleError, dense_to_triplets
from topologies.weights import check_node_labels, graph_weights


def _require_power_of_two(name: str, what: str, value: int, minimum: int = 2, hint: str = "") -> tuple[int, int]:
    """(value as an int, log2 of it), or ScheduleError unless value is an integer power of two >= minimum."""
    value = integer(what, value)
    if value < minimum or value & (value - 1):
        raise ScheduleError(
            f"{name} needs {what} to be a power of two >= {minimum}, got {what}={value!r}"
            + (f"; {hint}" if hint else "")
        )
    return value, value.bit_length() - 1


def _pairs(partner: np.ndarray) -> Triplets:
    """W = (I + P)/2 for the involution partner[i]; a rank with partner[i] == i keeps weight 1."""
    n = partner.size
    ranks = np.arange(n)
    alone = partner == ranks
    self_weight = np.where(alone, 1.0, 0.5)
    paired = ranks[~alone]
    return (
        np.concatenate([ranks, paired]),
        np.concatenate([ranks, partner[paired]]),
        np.concatenate([self_weight, np.full(paired.size, 0.5)]),
    )


def _group_average(groups: Sequence[Sequence[int]]) -> Triplets:
    """Exact averaging inside each group: W_ij = 1/|g| for i, j in g."""
    rows, cols, vals = [], [], []
    for group in groups:
        members = np.asarray(group, dtype=np.int64)
        rows.append(np.repeat(members, members.size))
        cols.append(np.tile(members, members.size))
        vals.append(np.full(members.size**2, 1.0 / members.size))
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)


def one_peer_ring(n: int) -> Schedule:
    """Decent-DP's one-peer ring (B.2): even t pairs {2k, 2k+1}, odd t pairs {2k, 2k-1 mod n}; weights 1/2.

    Period 2; needs even n >= 2 (odd n would leave a rank without partner).

    Args:
        n: the number of ranks, even and >= 2.

    Returns:
        The validated schedule: symmetric, doubly stochastic, period 2.

    Raises:
        ScheduleError: ``n`` is not an even integer >= 2.
    """
    n = integer("n", n)
    if n < 2 or n % 2:
        raise ScheduleError(f"one_peer_ring needs an even n >= 2, got n={n!r}; use ring(n) for odd n")
    ranks = np.arange(n)
    partners = (ranks ^ 1, np.where(ranks % 2 == 0, (ranks - 1) % n, (ranks + 1) % n))
    return Schedule(
        n,
        "one_peer_ring",
        lambda phase: _pairs(partners[phase]),
        2,
        params={"n": n},
        symmetric=True,
        doubly_stochastic=True,
    )


def one_peer_exponential(n: int) -> Schedule:
    """Ying et al. one-peer exponential graph (docs/design.md F.2), period tau = log2 n.

    Rank i sends to (i + 2^(t mod tau)) mod n and receives from (i - 2^(t mod tau)) mod n, weights 1/2 self and
    1/2 received. Directed, doubly stochastic; the product of tau consecutive matrices is exactly
    J = (1/n) 1 1^T. Needs n = 2^K >= 2 (otherwise no finite-time exactness: use static_exponential or
    random_matchings).

    Args:
        n: the number of ranks, a power of two >= 2.

    Returns:
        The validated schedule: directed, doubly stochastic, period log2 n.

    Raises:
        ScheduleError: ``n`` is not a power of two >= 2.
    """
    n, tau = _require_power_of_two(
        "one_peer_exponential", "n", n, hint="use base_graph(n) (exact after one period) or static_exponential(n)"
    )
    ranks = np.arange(n)

    def step(phase: int) -> Triplets:
        sender = (ranks - 2**phase) % n
        return np.concatenate([ranks, ranks]), np.concatenate([ranks, sender]), np.full(2 * n, 0.5)

    return Schedule(n, "one_peer_exponential", step, tau, params={"n": n}, doubly_stochastic=True)


def one_peer_hypercube(n: int) -> Schedule:
    """One-peer hypercube (Decent-DP ``one-peer-exp``, F.2): i <-> i XOR 2^(t mod log2 n), weights 1/2.

    Symmetric pairwise exchange (the natural default for PowerGossip), exact average after log2 n steps.
    Needs n = 2^K >= 2.

    Args:
        n: the number of ranks, a power of two >= 2.

    Returns:
        The validated schedule: symmetric, doubly stochastic, period log2 n.

    Raises:
        ScheduleError: ``n`` is not a power of two >= 2.
    """
    hint = "use base_graph(n) otherwise (exact after one period, any n)"
    n, tau = _require_power_of_two("one_peer_hypercube", "n", n, hint=hint)
    ranks = np.arange(n)
    return Schedule(
        n,
        "one_peer_hypercube",
        lambda phase: _pairs(ranks ^ (1 << phase)),
        tau,
        params={"n": n},
        symmetric=True,
        doubly_stochastic=True,
    )


def random_matchings(n: int, seed: int = 0, *, window: int = DEFAULT_APERIODIC_WINDOW) -> Schedule:
    """A fresh random perfect matching every step, weights 1/2 (aperiodic, symmetric, doubly stochastic).

    Step t draws ``perm = np.random.default_rng([seed, t]).permutation(n)`` and pairs perm[2k] with
    perm[2k+1], so any step is computable directly and identical on every rank. Odd n (documented
    generalisation): the last rank of perm sits the step out (W_ii = 1); the matrix stays symmetric and
    doubly stochastic. Validation, the symmetry flags and the fingerprint cover the first ``window`` steps.

    Args:
        n: the number of ranks, >= 2.
        seed: the seed of the matchings, a non-negative integer.
        window: the number of steps checked, >= 1.

    Returns:
        The validated aperiodic schedule.

    Raises:
        ScheduleError: ``n`` < 2, a negative ``seed``, a ``window`` < 1, or an argument that is not an integer.
    """
    n, seed, window = integer("n", n), integer("seed", seed), integer("window", window)
    if n < 2:
        raise ScheduleError(f"random_matchings needs n >= 2 ranks, got n={n!r}")
    if seed < 0:
        raise ScheduleError(f"random_matchings needs a non-negative integer seed, got seed={seed!r}")

    def step(t: int) -> Triplets:
        perm = np.random.default_rng([seed, t]).permutation(n)
        partner = np.arange(n)
        half = n // 2
        partner[perm[0 : 2 * half : 2]] = perm[1 : 2 * half : 2]
        partner[perm[1 : 2 * half : 2]] = perm[0 : 2 * half : 2]
        return _pairs(partner)

    return Schedule(
        n,
        "random_matchings",
        step,
        None,
        window=window,
        params={"n": n, "seed": seed},
        symmetric=True,
        doubly_stochastic=True,
    )


def cyclic(items: Sequence, weights: str = "metropolis", *, name: str = "cyclic") -> Schedule:
    """Round-robin over ``items`` (Schedules, networkx graphs or n x n matrices).

    Step t uses item k = t mod m at that item's own step t // m (a combined counter, so periods of the
    items never alias, F.2). Period m * lcm(item periods); aperiodic if any item is. Graphs are weighted
    with ``weights``. Graph and matrix items are validated as steps of the cycle (the union over the
    period must be strongly connected, not each item); Schedule items are already valid on their own.

    Args:
        items: the steps of the cycle: Schedules, networkx graphs on nodes 0..n-1 or (n, n) matrices, all of the
            same n.
        weights: the edge weighting of graph items, ``"uniform"``, ``"metropolis"`` or ``"attribute"``.
        name: the schedule's name.

    Returns:
        The validated schedule.

    Raises:
        ScheduleError: ``items`` is empty, an item is of another type, a matrix is not square, the items differ
            in n, or the cycle fails validation.
    """
    if not items:
        raise ScheduleError("cyclic needs at least one graph, matrix or schedule")
    schedules = [_as_schedule(item, weights, k) for k, item in enumerate(items)]
    n = schedules[0].n
    for k, s in enumerate(schedules):
        if s.n != n:
            raise ScheduleError(f"cyclic item {k} ('{s.name}') has n={s.n} but item 0 has n={n}; all must match")
    m = len(schedules)
    periods = [s.period for s in schedules]
    period = None if None in periods else m * math.lcm(*periods)
    window = m * max(s.window for s in schedules)

    def step(phase: int) -> Triplets:
        return schedules[phase % m].triplets(phase // m)

    params = {"items": [s.name for s in schedules]}
    return Schedule(n, name, step, period, window=window, params=params)


def _as_schedule(item, weights: str, index: int) -> Schedule:
    """Schedules are used as given (already validated); a graph or matrix becomes a step that is checked
    only as part of the cycle, so no single item needs to be connected on its own."""
    if isinstance(item, Schedule):
        return item
    if isinstance(item, nx.Graph):
        n, triplets = check_node_labels(item), graph_weights(item, weights)
    elif isinstance(item, np.ndarray):
        if item.ndim != 2 or item.shape[0] != item.shape[1]:
            raise ScheduleError(f"cyclic item {index} must be a square (n, n) matrix, got shape {item.shape}")
        n, triplets = item.shape[0], dense_to_triplets(np.asarray(item, dtype=np.float64))
    else:
        raise ScheduleError(f"cyclic item {index} is a {type(item).__name__}; expected a Schedule, graph or matrix")
    return Schedule(n, f"item{index}", lambda phase: triplets, period=1, validate=False)


def _node_ranks(node: int, per_node: int) -> list[int]:
    return list(range(node * per_node, (node + 1) * per_node))


def alternating_exp_ring(nodes: int, per_node: int) -> Schedule:
    """Decent-DP's alternating exp-ring (AER, B.2) over ``nodes`` nodes of ``per_node`` ranks.

    For dimension k = 0..log2(nodes)-1 the node pairs are (u, u XOR 2^k), numbered c = k * nodes/2 + index
    (index by ascending lower node u). Steps 2k and 2k+1: pair c forms one 2L-rank group (w = 1/(2L)) in
    one of them and two L-rank node groups (w = 1/L) in the other; even c does intra-node first, odd c
    inter-node first, so in any step half of the nodes use their NIC. Period 2 log2(nodes); the product
    over a period is exactly J. Needs nodes = 2^K >= 2 and per_node >= 2 (with per_node = 1 the intra
    steps do nothing: use one_peer_hypercube(nodes)).

    Args:
        nodes: the number of nodes, a power of two >= 2.
        per_node: the ranks per node, >= 2; rank = node * per_node + local_rank.

    Returns:
        The validated schedule over nodes * per_node ranks: symmetric, doubly stochastic, period 2 log2(nodes).

    Raises:
        ScheduleError: ``nodes`` is not a power of two >= 2, or ``per_node`` is not an integer >= 2.
    """
    nodes, dims = _require_power_of_two("alternating_exp_ring", "nodes", nodes)
    per_node = integer("per_node", per_node)
    if per_node < 2:
        raise ScheduleError(
            f"alternating_exp_ring needs per_node >= 2, got per_node={per_node!r}; "
            "with one rank per node use one_peer_hypercube(nodes)"
        )
    phases: list[Triplets] = []
    for k in range(dims):
        first, second = [], []
        lower_nodes = [u for u in range(nodes) if not u & (1 << k)]
        for index, u in enumerate(lower_nodes):
            v = u | (1 << k)
            inter = [_node_ranks(u, per_node) + _node_ranks(v, per_node)]
            intra = [_node_ranks(u, per_node), _node_ranks(v, per_node)]
            c = k * (nodes // 2) + index
            first += intra if c % 2 == 0 else inter
            second += inter if c % 2 == 0 else intra
        phases += [_group_average(first), _group_average(second)]
    return Schedule(
        nodes * per_node,
        "alternating_exp_ring",
        phases.__getitem__,
        2 * dims,
        params={"nodes": nodes, "per_node": per_node},
        symmetric=True,
        doubly_stochastic=True,
    )


def hierarchical(nodes: int, per_node: int) -> Schedule:
    """Hierarchical gossip (E.2): W(t) = W_node(t) kron (1/L) 1 1^T.

    W_node(t) is the one-peer hypercube over nodes (partner u XOR 2^(t mod log2 nodes)), so each rank
    averages exactly over its node and its partner node (2L ranks, w = 1/(2L)). Symmetric, doubly
    stochastic, exact after log2(nodes) steps. nodes must be a power of two; nodes = 1 is the exact
    intra-node average (period 1).

    Args:
        nodes: the number of nodes, a power of two >= 1.
        per_node: the ranks per node, >= 1; rank = node * per_node + local_rank.

    Returns:
        The validated schedule over nodes * per_node ranks, period max(log2(nodes), 1).

    Raises:
        ScheduleError: ``nodes`` is not a power of two >= 1, or ``per_node`` is not an integer >= 1.
    """
    nodes, dims = _require_power_of_two("hierarchical", "nodes", nodes, minimum=1)
    per_node = integer("per_node", per_node)
    if per_node < 1:
        raise ScheduleError(f"hierarchical needs per_node >= 1, got per_node={per_node!r}")
    if dims == 0:
        phases = [_group_average([_node_ranks(0, per_node)])]
    else:
        phases = [
            _group_average(
                [
                    _node_ranks(u, per_node) + _node_ranks(u ^ (1 << k), per_node)
                    for u in range(nodes)
                    if not u & (1 << k)
                ]
            )
            for k in range(dims)
        ]
    return Schedule(
        nodes * per_node,
        "hierarchical",
        phases.__getitem__,
        max(dims, 1),
        params={"nodes": nodes, "per_node": per_node},
        symmetric=True,
        doubly_stochastic=True,
    )
