"""Checks that a schedule is a valid gossip schedule (docs/design.md F, A.8; issue 3 item 4).

Per step t over one period (or the first ``window`` steps of an aperiodic schedule):

- non-negative:       W_ij(t) >= 0
- row-stochastic:     sum_j W_ij(t) = 1           (mixing keeps consensus vectors fixed)
- column-stochastic:  sum_i W_ij(t) = 1           (with row-stochastic: doubly stochastic, keeps the average)
- symmetric:          W(t) = W(t)^T               (pairwise exchange, needed by PowerGossip, A.3)
- peer-consistency:   j in out_peers(i) with weight w  <=>  i in in_peers(j) with weight w

and once for the union graph over those steps:

- strongly-connected: every rank's value reaches every other rank over one period.

Every failure raises :class:`ScheduleError` naming the schedule, step, rank(s) and property.
"""

from __future__ import annotations

from itertools import chain
from typing import Protocol

import networkx as nx
import numpy as np

from topologies.peer_view import PeerView, Triplets


class CheckedSchedule(Protocol):
    """What the checks read of a schedule; :class:`topologies.schedule.Schedule` is the one they are made for.

    Attributes:
        name: the schedule's name, used in messages.
        n: the number of ranks.
    """

    name: str
    n: int

    @property
    def check_steps(self) -> range:
        """The steps the checks cover: one period, or the first ``window`` steps when aperiodic."""

    def triplets(self, t: int) -> Triplets:
        """W(t) in coordinate form.

        Args:
            t: the step.

        Returns:
            (rows, cols, weights) with W[rows[k], cols[k]] = weights[k].
        """

    def peers(self, rank: int, t: int) -> PeerView:
        """One rank's view of step t, which must agree with :meth:`triplets`.

        Args:
            rank: the rank, in 0..n-1.
            t: the step.

        Returns:
            The rank's self weight, in-peers and out-peers at step t.
        """


class ScheduleError(ValueError):
    """A schedule, or a request to it, is invalid. The message names the step, rank(s) and property."""


#: Absolute tolerance on row/column sums and on symmetry.
TOLERANCE = 1e-9

PER_STEP_PROPERTIES = ("non-negative", "row-stochastic", "column-stochastic", "symmetric", "peer-consistency")

_ADVICE = {
    "non-negative": "weights must be >= 0",
    "row-stochastic": "normalise each row of W(t) to sum to 1 (e.g. weights='metropolis' or 'uniform')",
    "column-stochastic": "use a doubly stochastic weighting, e.g. 'metropolis' on an undirected graph",
    "symmetric": "use an undirected graph or pairwise schedule (e.g. one_peer_hypercube)",
    "peer-consistency": "peers() must agree with mixing_matrix(); do not override one without the other",
    "strongly-connected": "add edges or steps so the union graph over one period is strongly connected",
}


def _fail(schedule: CheckedSchedule, prop: str, where: str, detail: str) -> str:
    return f"schedule '{schedule.name}' (n={schedule.n}) fails property '{prop}' {where}: {detail}; {_ADVICE[prop]}"


def _ranks(mask: np.ndarray, limit: int = 8) -> str:
    ranks = np.flatnonzero(mask).tolist()
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"{ranks[:limit]}{more}"


def _step_violation(schedule: CheckedSchedule, prop: str, t: int) -> str | None:
    n = schedule.n
    rows, cols, weights = schedule.triplets(t)
    where = f"at step {t}"
    if prop == "non-negative":
        negative = weights < 0
        if negative.any():
            k = int(np.argmax(negative))
            return _fail(schedule, prop, where, f"rank {rows[k]} gives weight {weights[k]:.6g} to rank {cols[k]}")
    elif prop in ("row-stochastic", "column-stochastic"):
        index = rows if prop == "row-stochastic" else cols
        sums = np.bincount(index, weights=weights, minlength=n)
        bad = np.abs(sums - 1.0) > TOLERANCE
        if bad.any():
            axis = "row" if prop == "row-stochastic" else "column"
            shown = ", ".join(f"{s:.6g}" for s in sums[bad][:8])
            return _fail(schedule, prop, f"{where}, rank(s) {_ranks(bad)}", f"{axis} sums {shown} (expected 1)")
    elif prop == "symmetric":
        order = np.lexsort((rows, cols))
        same_pattern = np.array_equal(rows, cols[order]) and np.array_equal(cols, rows[order])
        if not same_pattern:
            pattern = set(zip(rows.tolist(), cols.tolist(), strict=True))
            i, j = next((i, j) for i, j in sorted(pattern) if (j, i) not in pattern)
            return _fail(schedule, prop, f"{where}, ranks ({i}, {j})", f"W[{i},{j}] > 0 but W[{j},{i}] = 0")
        diff = np.abs(weights - weights[order]) > TOLERANCE
        if diff.any():
            k = int(np.argmax(diff))
            i, j = int(rows[k]), int(cols[k])
            detail = f"W[{i},{j}] = {weights[k]:.6g} but W[{j},{i}] = {weights[order][k]:.6g}"
            return _fail(schedule, prop, f"{where}, ranks ({i}, {j})", detail)
    elif prop == "peer-consistency":
        return _peer_violation(schedule, t)
    else:
        raise ValueError(f"unknown property {prop!r}; expected one of {PER_STEP_PROPERTIES}")
    return None


def find_violation(schedule: CheckedSchedule, prop: str) -> str | None:
    """The message for the first step in ``schedule.check_steps`` that violates ``prop``.

    Args:
        schedule: the schedule to check.
        prop: one of PER_STEP_PROPERTIES or ``"strongly-connected"`` (checked on the union graph).

    Returns:
        The message a ScheduleError would carry, naming the step, rank(s) and property; None when ``prop`` holds.

    Raises:
        ValueError: ``prop`` is not a known property.
    """
    if prop == "strongly-connected":
        return _connectivity_violation(schedule)
    for t in schedule.check_steps:
        message = _step_violation(schedule, prop, t)
        if message is not None:
            return message
    return None


def union_graph(schedule: CheckedSchedule) -> nx.DiGraph:
    """The union over ``check_steps`` of the step graphs.

    Args:
        schedule: the schedule whose steps are joined.

    Returns:
        A DiGraph on the ranks with an edge j -> i when rank i receives from j at some step (no self loops).
    """
    union = nx.DiGraph()
    union.add_nodes_from(range(schedule.n))
    senders, receivers = _union_edges(schedule)
    union.add_edges_from(zip(senders.tolist(), receivers.tolist(), strict=True))
    return union


def _union_edges(schedule: CheckedSchedule) -> tuple[np.ndarray, np.ndarray]:
    """(senders, receivers) of every positive off-diagonal entry over ``check_steps`` (repeats kept)."""
    senders, receivers = [], []
    for t in schedule.check_steps:
        rows, cols, weights = schedule.triplets(t)
        positive = (weights > 0) & (rows != cols)
        senders.append(cols[positive])
        receivers.append(rows[positive])
    return np.concatenate(senders).astype(np.int64), np.concatenate(receivers).astype(np.int64)


def _reaches_every_rank(n: int, tails: np.ndarray, heads: np.ndarray) -> bool:
    """Whether breadth-first search from rank 0 along the edges tails[k] -> heads[k] reaches all n ranks.

    Each rank enters the frontier at most once and each edge is read once, when its tail does: O(n + edges).
    """
    order = np.argsort(tails, kind="stable")
    starts_of = np.concatenate(([0], np.cumsum(np.bincount(tails, minlength=n))))
    targets = heads[order]
    reached = np.zeros(n, dtype=bool)
    reached[0] = True
    frontier = np.zeros(1, dtype=np.int64)
    while frontier.size:
        starts, lengths = starts_of[frontier], starts_of[frontier + 1] - starts_of[frontier]
        offsets = np.cumsum(lengths) - lengths  # where each frontier rank's edges begin in the gathered list
        gathered = targets[np.repeat(starts - offsets, lengths) + np.arange(lengths.sum())]
        frontier = np.unique(gathered[~reached[gathered]])
        reached[frontier] = True
    return bool(reached.all())


def _connectivity_violation(schedule: CheckedSchedule) -> str | None:
    # Strongly connected <=> rank 0 reaches every rank and every rank reaches rank 0 (search on the reversed edges).
    senders, receivers = _union_edges(schedule)
    n = schedule.n
    if _reaches_every_rank(n, senders, receivers) and _reaches_every_rank(n, receivers, senders):
        return None
    union = union_graph(schedule)  # only to name the components in the message
    components = sorted((sorted(c) for c in nx.strongly_connected_components(union)), key=lambda c: c[0])
    shown = "; ".join(str(c if len(c) <= 8 else [*c[:8], "..."]) for c in components[:4])
    steps = schedule.check_steps
    where = f"over steps {steps.start}..{steps.stop - 1}"
    return _fail(schedule, "strongly-connected", where, f"{len(components)} components: {shown}")


def _listed(views: list[PeerView], side: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair (j, w) of ``view.<side>`` over all views, in walk order: (listing rank, j, w) as arrays."""
    lists = [getattr(view, side) for view in views]
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    total = int(lengths.sum())
    pairs = np.fromiter(chain.from_iterable(chain.from_iterable(lists)), dtype=np.float64, count=2 * total)
    owners = np.repeat(np.fromiter((view.rank for view in views), dtype=np.int64, count=len(views)), lengths)
    return owners, pairs[0::2].astype(np.int64), pairs[1::2]


def _same_entries(n: int, a: Triplets, b: Triplets) -> bool:
    """Whether the (row, col, weight) entries of a and b are the same multiset, judged after sorting by position.

    True proves the property; False (also for equal multisets whose repeated positions sort differently) sends
    the caller to the exact, slower search for the first violation.
    """
    if a[0].size != b[0].size:
        return False
    order_a = np.argsort(a[0] * n + a[1], kind="stable")
    order_b = np.argsort(b[0] * n + b[1], kind="stable")
    return all(np.array_equal(x[order_a], y[order_b]) for x, y in zip(a, b, strict=True))


def _peer_violation(schedule: CheckedSchedule, t: int) -> str | None:
    """j in out_peers(i) with weight w <=> i in in_peers(j) with weight w.

    An in-peer (j, w) of rank i claims W[i, j] = w and an out-peer (j, w) of rank i claims W[j, i] = w; the
    property holds when both lists make the same set of claims. Both are flattened once and compared after
    sorting by position, O(E log E) for E listed pairs whatever the degrees. Only when they differ is the first
    violation searched for, as a rank-by-rank walk meets it: lowest rank, its out-peers before its in-peers.
    """
    views = [schedule.peers(rank, t) for rank in range(schedule.n)]
    in_owners, in_peers, in_weights = _listed(views, "in_peers")
    out_owners, out_peers, out_weights = _listed(views, "out_peers")
    claimed_by_in = (in_owners, in_peers, in_weights)
    claimed_by_out = (out_peers, out_owners, out_weights)
    if _same_entries(schedule.n, claimed_by_in, claimed_by_out):
        return None
    in_claims = set(zip(*(a.tolist() for a in claimed_by_in), strict=True))
    out_claims = set(zip(*(a.tolist() for a in claimed_by_out), strict=True))
    for view in views:
        for j, w in view.out_peers:
            if (j, view.rank, w) not in in_claims:
                detail = f"rank {view.rank} lists {j} as out-peer (w={w:.6g}) but {j} has no such in-peer"
                return _fail(schedule, "peer-consistency", f"at step {t}, ranks ({view.rank}, {j})", detail)
        for j, w in view.in_peers:
            if (view.rank, j, w) not in out_claims:
                detail = f"rank {view.rank} lists {j} as in-peer (w={w:.6g}) but {j} has no such out-peer"
                return _fail(schedule, "peer-consistency", f"at step {t}, ranks ({view.rank}, {j})", detail)
    return None  # the same claims, listed in another order or with repeats


def validate_schedule(schedule: CheckedSchedule, *, symmetric: bool = False, doubly_stochastic: bool = False) -> None:
    """Check the properties of the module docstring and raise on the first one violated.

    Per step, in step order: non-negative, row-stochastic, peer-consistency, then column-stochastic and symmetric
    when asked for; then strongly-connected over the union graph.

    Args:
        schedule: the schedule to check.
        symmetric: also require every W(t) to be symmetric.
        doubly_stochastic: also require every W(t) to be column-stochastic.

    Raises:
        ScheduleError: the first violated property, naming the schedule, step, rank(s) and property.
    """
    props = ["non-negative", "row-stochastic", "peer-consistency"]
    if doubly_stochastic:
        props.append("column-stochastic")
    if symmetric:
        props.append("symmetric")
    for t in schedule.check_steps:
        for prop in props:
            message = _step_violation(schedule, prop, t)
            if message is not None:
                raise ScheduleError(message)
    message = _connectivity_violation(schedule)
    if message is not None:
        raise ScheduleError(message)
