"""The schedule abstraction: who mixes with whom, with which weights, at step t.

A schedule is a pure function of the step t -> mixing matrix W(t), identical on every rank without
communication. Mixing semantics (docs/design.md F): x_i <- sum_j W_ij(t) x_j, so rank i *receives* x_j from
every in-peer j (W_ij > 0) and *sends* x_i to every out-peer j (W_ji > 0).

Internally a step is stored sparsely as coordinate triplets (rows, cols, weights) so that ``peers()`` never
builds an n x n matrix; dense matrices are built only on request (``mixing_matrix``, analysis).
"""

from __future__ import annotations

import functools
import hashlib
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import networkx as nx
import numpy as np

from topologies.arguments import integer
from topologies.peer_view import PeerView, Triplets

# ScheduleError is defined next to the checks that raise most of them; topologies.ScheduleError is the same class.
from topologies.validation import ScheduleError, find_violation, validate_schedule

#: Steps checked for aperiodic schedules (random matchings) by validation, symmetry flags and fingerprint.
DEFAULT_APERIODIC_WINDOW = 32

StepFunction = Callable[[int], Triplets]


@dataclass(frozen=True)
class _PhaseTable:
    """One step in canonical sparse form plus every rank's peer lists (built once per phase)."""

    rows: np.ndarray
    cols: np.ndarray
    weights: np.ndarray
    self_weights: tuple[float, ...]
    in_peers: tuple[tuple[tuple[int, float], ...], ...]
    out_peers: tuple[tuple[tuple[int, float], ...], ...]


def canonical_triplets(n: int, rows, cols, weights) -> Triplets:
    """W in canonical coordinate form: duplicate (row, col) entries summed, exact zeros dropped, sorted by (row, col).

    Args:
        n: the number of ranks; every row and column index must lie in 0..n-1.
        rows: the row index of each entry (any integer array-like).
        cols: the column index of each entry.
        weights: the value of each entry.

    Returns:
        (rows, cols, weights) as int64, int64 and float64 arrays.

    Raises:
        ScheduleError: the three differ in length, or an index lies outside 0..n-1.
    """
    rows = np.asarray(rows, dtype=np.int64).ravel()
    cols = np.asarray(cols, dtype=np.int64).ravel()
    weights = np.asarray(weights, dtype=np.float64).ravel()
    if not (rows.shape == cols.shape == weights.shape):
        raise ScheduleError(f"rows, cols and weights differ in length: {rows.size}, {cols.size}, {weights.size}")
    bad = (rows < 0) | (rows >= n) | (cols < 0) | (cols >= n)
    if bad.any():
        k = int(np.argmax(bad))
        raise ScheduleError(f"entry ({rows[k]}, {cols[k]}) names a rank outside 0..{n - 1} (n={n})")
    keys, inverse = np.unique(rows * n + cols, return_inverse=True)
    summed = np.bincount(inverse, weights=weights, minlength=keys.size)
    keep = summed != 0.0
    return keys[keep] // n, keys[keep] % n, summed[keep]


def _peer_lists(
    n: int, owners: np.ndarray, peers: np.ndarray, weights: np.ndarray
) -> tuple[tuple[tuple[int, float], ...], ...]:
    """For each rank r, the (peer, weight) pairs of the entries it owns; ``owners`` must be sorted."""
    bounds = np.searchsorted(owners, np.arange(n + 1)).tolist()
    peer_list, weight_list = peers.tolist(), weights.tolist()
    return tuple(
        tuple(zip(peer_list[start:stop], weight_list[start:stop], strict=True)) for start, stop in pairwise(bounds)
    )


def dense_to_triplets(matrix: np.ndarray) -> Triplets:
    """The non-zero entries of a dense matrix in coordinate form.

    Args:
        matrix: a dense (n, n) mixing matrix.

    Returns:
        (rows, cols, weights) of the non-zero entries, in row-major order.
    """
    rows, cols = np.nonzero(matrix)
    return rows, cols, matrix[rows, cols]


class Schedule:
    """A (possibly time-varying) mixing schedule over n ranks.

    Built from ``step_function(phase) -> (rows, cols, weights)`` with W[rows[k], cols[k]] = weights[k]
    (duplicates are summed). For a periodic schedule ``phase = t mod period``; for an aperiodic one
    (``period=None``) ``phase = t``, and properties are checked over the first ``window`` steps.
    Constructed schedules are validated (see :mod:`topologies.validation`); pass ``validate=False`` only
    for schedules you validate yourself.

    Args:
        n: the number of ranks, an integer >= 1.
        name: the schedule's name, used in messages, ``repr`` and the fingerprint.
        step_function: phase -> (rows, cols, weights) of W(phase); called once per phase and cached.
        period: the period p >= 1, or None for an aperiodic schedule.
        window: the number of steps checked when aperiodic, >= 1.
        params: the constructor's parameters, shown by ``repr``.
        validate: check the contract at construction (see :meth:`validate`).
        symmetric: with ``validate``, also require every W(t) to be symmetric.
        doubly_stochastic: with ``validate``, also require every W(t) to be doubly stochastic.

    Raises:
        ScheduleError: ``n``, ``period`` or ``window`` is not an integer >= 1, or the schedule fails validation
            (the message names the step, rank(s) and property).
    """

    def __init__(
        self,
        n: int,
        name: str,
        step_function: StepFunction,
        period: int | None,
        *,
        window: int = DEFAULT_APERIODIC_WINDOW,
        params: dict | None = None,
        validate: bool = True,
        symmetric: bool = False,
        doubly_stochastic: bool = False,
    ) -> None:
        self.n = integer("n", n, 1)
        self.name = name
        self.period = None if period is None else integer("period", period, 1)
        self.window = integer("window", window, 1)
        self.params = dict(params or {})
        self._step_function = step_function
        cache_size = self.period if self.period is not None and self.period <= 1024 else 64
        self._table = functools.lru_cache(maxsize=cache_size)(self._build_table)
        if validate:
            self.validate(symmetric=symmetric, doubly_stochastic=doubly_stochastic)

    # ------------------------------------------------------------------ steps and phases
    @property
    def check_steps(self) -> range:
        """The steps over which properties are checked: one period, or the first ``window`` steps."""
        return range(self.period if self.period is not None else self.window)

    def phase(self, t: int) -> int:
        """The index of step t inside the period, t mod period (t itself for an aperiodic schedule).

        Args:
            t: the step, an integer >= 0.

        Returns:
            The phase, in 0..period-1 (t when aperiodic).

        Raises:
            ScheduleError: ``t`` is negative or not an integer (a bool included).
        """
        if type(t) is not int and (not isinstance(t, numbers.Integral) or isinstance(t, bool)):  # int: the fast path
            raise ScheduleError(f"step must be an integer, got {t!r} for schedule '{self.name}'")
        if t < 0:
            raise ScheduleError(f"step t={t} is negative for schedule '{self.name}'; steps count from 0")
        return int(t) % self.period if self.period is not None else int(t)

    def _check_rank(self, rank: int) -> int:
        integral = type(rank) is int or (isinstance(rank, numbers.Integral) and not isinstance(rank, bool))
        if not integral or not 0 <= rank < self.n:
            raise ScheduleError(
                f"rank {rank!r} is out of range for schedule '{self.name}' with n={self.n} (valid: 0..{self.n - 1})"
            )
        return int(rank)

    def require_size(self, world_size: int) -> None:
        """Check that the schedule was built for ``world_size`` ranks.

        Args:
            world_size: the number of ranks of the process group.

        Raises:
            ScheduleError: ``world_size`` differs from the schedule's n.
        """
        if world_size != self.n:
            raise ScheduleError(
                f"schedule '{self.name}' is built for n={self.n} ranks but the world has {world_size}; "
                f"build it with n={world_size}"
            )

    def _build_table(self, phase: int) -> _PhaseTable:
        rows, cols, weights = canonical_triplets(self.n, *self._step_function(phase))
        diagonal = rows == cols
        self_weights = np.zeros(self.n)
        self_weights[rows[diagonal]] = weights[diagonal]
        off = ~diagonal & (weights > 0)
        receivers, senders, off_weights = rows[off], cols[off], weights[off]  # sorted by (receiver, sender)
        by_sender = np.lexsort((receivers, senders))
        return _PhaseTable(
            rows,
            cols,
            weights,
            tuple(self_weights.tolist()),
            _peer_lists(self.n, receivers, senders, off_weights),
            _peer_lists(self.n, senders[by_sender], receivers[by_sender], off_weights[by_sender]),
        )

    def triplets(self, t: int) -> Triplets:
        """W(t) in canonical sparse form, sorted by (row, col).

        Args:
            t: the step, an integer >= 0.

        Returns:
            (rows, cols, weights) with W[rows[k], cols[k]] = weights[k], duplicates summed and zeros dropped.

        Raises:
            ScheduleError: ``t`` is negative or not an integer.
        """
        table = self._table(self.phase(t))
        return table.rows, table.cols, table.weights

    # ------------------------------------------------------------------ the contract
    def mixing_matrix(self, t: int) -> np.ndarray:
        """The dense mixing matrix W(t).

        Args:
            t: the step, an integer >= 0.

        Returns:
            W(t), float64 of shape (n, n); W[i, j] is the weight rank i gives to x_j.

        Raises:
            ScheduleError: ``t`` is negative or not an integer.
        """
        rows, cols, weights = self.triplets(t)
        matrix = np.zeros((self.n, self.n))
        matrix[rows, cols] = weights
        return matrix

    def peers(self, rank: int, t: int) -> PeerView:
        """The rank's self weight, in-peers and out-peers at step t (cached per phase).

        Args:
            rank: the rank, an integer in 0..n-1.
            t: the step, an integer >= 0.

        Returns:
            The rank's view of step t.

        Raises:
            ScheduleError: ``rank`` is out of range or not an integer, or ``t`` is negative or not an integer.
        """
        rank = self._check_rank(rank)
        table = self._table(self.phase(t))
        return PeerView(rank, int(t), table.self_weights[rank], table.in_peers[rank], table.out_peers[rank])

    def graph(self, t: int) -> nx.DiGraph:
        """Step t as a networkx DiGraph.

        Args:
            t: the step, an integer >= 0.

        Returns:
            A graph on the ranks with an edge j -> i of weight W[i, j] for every entry (i receives from j);
                self loops carry W[i, i].

        Raises:
            ScheduleError: ``t`` is negative or not an integer.
        """
        rows, cols, weights = self.triplets(t)
        g = nx.DiGraph(name=f"{self.name}@{t}")
        g.add_nodes_from(range(self.n))
        g.add_weighted_edges_from(zip(cols.tolist(), rows.tolist(), weights.tolist(), strict=True))
        return g

    def groups(self, t: int) -> list[tuple[int, ...]] | None:
        """The partition of ranks into exact-averaging groups at step t, or None.

        A step is a group partition when every rank i gives weight 1/|g| to each member of its group
        g = {i} U in_peers(i) and all members of g have the same group.

        Checked per entry: with L(i) = min g(i), the ranks with L(i) = L form the candidate group S_L. Every
        in-peer j of i must have L(j) = L(i) (so g(i) is inside S_L) and |g(i)| = |S_L(i)| (so g(i) is all of it);
        conversely a partition satisfies both. O(n + entries).

        Args:
            t: the step, an integer >= 0.

        Returns:
            The groups, each a sorted tuple of ranks, ordered by their lowest rank; None when the step is
                not a group partition.

        Raises:
            ScheduleError: ``t`` is negative or not an integer.
        """
        table = self._table(self.phase(t))
        rows, cols, weights = table.rows, table.cols, table.weights
        peer = (rows != cols) & (weights > 0)  # in_peers: receiver rows[peer] lists sender cols[peer]
        receivers, senders, peer_weights = rows[peer], cols[peer], weights[peer]
        sizes = 1 + np.bincount(receivers, minlength=self.n)
        self_weights = np.array(table.self_weights)
        if np.any(np.abs(self_weights - 1.0 / sizes) > 1e-12):
            return None
        if np.any(np.abs(peer_weights - 1.0 / sizes[receivers]) > 1e-12):
            return None
        lowest = np.arange(self.n)
        np.minimum.at(lowest, receivers, senders)  # L(i) = min of i and its in-peers
        if np.any(lowest[senders] != lowest[receivers]):
            return None
        if np.any(np.bincount(lowest, minlength=self.n)[lowest] != sizes):
            return None
        order = np.lexsort((np.arange(self.n), lowest))
        bounds = np.flatnonzero(np.diff(lowest[order])) + 1
        return [tuple(group.tolist()) for group in np.split(order, bounds)]

    @cached_property
    def is_symmetric(self) -> bool:
        """Every W(t) over ``check_steps`` equals its transpose (pairwise exchange)."""
        return find_violation(self, "symmetric") is None

    @cached_property
    def is_doubly_stochastic(self) -> bool:
        """Every W(t) over ``check_steps`` has rows and columns summing to 1."""
        return find_violation(self, "column-stochastic") is None

    def validate(self, *, symmetric: bool = False, doubly_stochastic: bool = False) -> None:
        """Check the schedule's contract over ``check_steps``.

        Always checked: non-negative, row-stochastic, in/out-peer consistency, union graph over
        ``check_steps`` strongly connected. Optionally: symmetric, doubly stochastic.

        Args:
            symmetric: also require every W(t) to be symmetric.
            doubly_stochastic: also require every W(t) to be column-stochastic.

        Raises:
            ScheduleError: the first violated property, naming the step, rank(s) and property.
        """
        validate_schedule(self, symmetric=symmetric, doubly_stochastic=doubly_stochastic)

    def fingerprint(self) -> str:
        """A SHA-256 digest of the schedule, equal on every rank that built the same schedule.

        It covers the name, n, period, window and the canonical matrices of ``check_steps``.

        Returns:
            The digest as 64 hexadecimal characters.
        """
        digest = hashlib.sha256()
        digest.update(f"{self.name}|n={self.n}|period={self.period}|window={self.window}".encode())
        for t in self.check_steps:
            rows, cols, weights = self.triplets(t)
            digest.update(np.int64(t).tobytes())
            for array in (rows.astype("<i8"), cols.astype("<i8"), weights.astype("<f8")):
                digest.update(array.tobytes())
        return digest.hexdigest()

    def __repr__(self) -> str:
        params = {"n": self.n, **self.params}
        args = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return f"<Schedule {self.name}({args}) period={self.period}>"
