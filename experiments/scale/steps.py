"""One step of a schedule as index arrays over the replica axis: who receives from whom, with which weight.

:class:`StepPlan` is W(t) of a :class:`topologies.Schedule` (read through ``schedule.triplets(t)``, so the engine
mixes over exactly the library's W(t)) in the forms the batched algorithms need:

* ``slots``: the k-th in-peer of every rank, in the order ``schedule.peers(rank, t).in_peers`` lists them (sorted by
  peer), as a partner index and a weight per rank (the rank itself and weight 0 where it has fewer peers). A
  one-peer schedule has one slot: mixing is the gather ``x[partner]``, never a dense ``W @ X``.
* ``ordered``: every rank's terms of :math:`\\sum_j W_{ij}(t) z_j` *this rank included*, sorted by rank, as
  the library's rank-order sums (the trackers', the mean gradient's samples) add them;
* ``edges``: the undirected edges lo < hi with their weight (the schedule must be symmetric for the per-edge
  algorithms, as PowerGossip and ChocoSign require).

:class:`StepPlans` builds them once per phase of a periodic schedule (every step of an aperiodic one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

import topologies


@dataclass(frozen=True)
class Terms:
    """One position of a per-rank list of weighted terms: every rank's index and weight at that position.

    Attributes:
        index: (n,) int64 on the device: whose value each rank takes at this position.
        peers: the same indices, a numpy array.
        weights: (n,) float64: its weight (0 where a rank's list is shorter).
        uniform: the weight when every rank has the same one at this position, else None.
    """

    index: Tensor
    peers: np.ndarray
    weights: np.ndarray
    uniform: float | None

    def column(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The weights as an (n, 1) tensor of ``dtype`` (each rounded once from float64, as a scalar would be).

        Args:
            dtype: the values' dtype.
            device: their device.

        Returns:
            The column.
        """
        return torch.tensor(self.weights, dtype=torch.float64).to(dtype=dtype, device=device).unsqueeze(1)


@dataclass(frozen=True)
class StepPlan:
    """W(t) as index arrays (module docstring).

    Attributes:
        n: the number of ranks.
        slots: the k-th in-peer of every rank, k = 0, 1, ...
        peer_sums: per rank, the sum of its in-peers' weights, added in slot order (as Python's ``sum``).
        ordered: per position, every rank's terms of its rank-order sum (itself included, weight
            ``1 - peer_sums``).
        lo: (E,) int64, the low end of each undirected edge (numpy).
        hi: (E,) int64, its high end.
        weights: (E,) float64, its weight W[lo, hi].
        slot_edges: per slot, (n,) int64: the edge each rank's k-th in-peer is on (-1 where none).
        active: per slot, the ranks that have a k-th in-peer (numpy, sorted).
    """

    n: int
    slots: list[Terms]
    peer_sums: np.ndarray
    ordered: list[Terms]
    lo: np.ndarray
    hi: np.ndarray
    weights: np.ndarray
    slot_edges: list[np.ndarray]
    active: list[np.ndarray]

    @property
    def one_peer(self) -> bool:
        """Whether every rank has at most one in-peer at this step."""
        return len(self.slots) <= 1

    @classmethod
    def build(cls, schedule: topologies.Schedule, t: int, device: torch.device) -> StepPlan:
        """W(t) of ``schedule`` as a plan.

        Args:
            schedule: the schedule.
            t: the step.
            device: where the index tensors go.

        Returns:
            The plan.
        """
        n = schedule.n
        rows, cols, weights = schedule.triplets(t)  # canonical: sorted by (row, col)
        off = (rows != cols) & (weights > 0)
        receivers, senders, peer_weights = rows[off], cols[off], weights[off]
        degree = np.bincount(receivers, minlength=n)
        first = np.concatenate([[0], np.cumsum(degree)[:-1]])
        position = np.arange(len(receivers)) - first[receivers]
        lower = receivers < senders  # each undirected edge once, as (lo, hi)
        lo, hi, edge_weights = receivers[lower], senders[lower], peer_weights[lower]
        edge_of = {(int(a), int(b)): e for e, (a, b) in enumerate(zip(lo, hi, strict=True))}
        ranks = np.arange(n)
        slots, slot_edges, active = [], [], []
        peer_sums = np.zeros(n)
        for k in range(int(degree.max()) if len(receivers) else 0):
            take = position == k
            partner, weight, edges = ranks.copy(), np.zeros(n), np.full(n, -1)
            partner[receivers[take]] = senders[take]
            weight[receivers[take]] = peer_weights[take]
            for i, j in zip(receivers[take], senders[take], strict=True):
                edges[i] = edge_of.get((int(min(i, j)), int(max(i, j))), -1)
            peer_sums = peer_sums + weight  # in slot order, as Python's sum over in_peers
            slots.append(_terms(partner, weight, device))
            slot_edges.append(edges)
            active.append(np.flatnonzero(degree > k))
        # rank-order terms: the in-peers and the rank itself (weight 1 - the in-peers' sum), sorted by rank
        lists = [[(i, 1.0 - peer_sums[i])] for i in range(n)]
        for r, s, w in zip(receivers, senders, peer_weights, strict=True):
            lists[r].append((int(s), float(w)))
        for terms in lists:
            terms.sort()
        ordered = []
        for p in range(max(len(terms) for terms in lists)):
            index, weight = ranks.copy(), np.zeros(n)
            for i, terms in enumerate(lists):
                if p < len(terms):
                    index[i], weight[i] = terms[p]
            ordered.append(_terms(index, weight, device))
        return cls(n, slots, peer_sums, ordered, lo, hi, edge_weights, slot_edges, active)


def _terms(index: np.ndarray, weights: np.ndarray, device: torch.device) -> Terms:
    uniform = float(weights[0]) if np.all(weights == weights[0]) else None
    return Terms(torch.as_tensor(index, dtype=torch.int64, device=device), index, weights, uniform)


class StepPlans:
    """The plans of one schedule, built once per phase (each step for an aperiodic schedule).

    Args:
        schedule: the schedule.
        device: where the index tensors go.
    """

    def __init__(self, schedule: topologies.Schedule, device: torch.device):
        self.schedule, self.device = schedule, device
        self._cache: dict[int, StepPlan] = {}

    def at(self, t: int) -> StepPlan:
        """The plan of step ``t``.

        Args:
            t: the step.

        Returns:
            W(t) as a :class:`StepPlan`.
        """
        if self.schedule.period is None:
            return StepPlan.build(self.schedule, t, self.device)
        phase = self.schedule.phase(t)
        if phase not in self._cache:
            self._cache[phase] = StepPlan.build(self.schedule, t, self.device)
        return self._cache[phase]


def schedule_edges(schedule: topologies.Schedule, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The undirected edges (lo < hi) that W(t) uses over ``steps`` steps (one period suffices), in order of use.

    Args:
        schedule: the schedule.
        steps: the steps of the run.

    Returns:
        (lo, hi), int64 arrays: what the per-edge stores reserve up front instead of growing step by step.
    """
    seen: dict[tuple[int, int], None] = {}
    span = steps if schedule.period is None else min(steps, schedule.period)
    for t in range(span):
        rows, cols, weights = schedule.triplets(t)
        for a, b in zip(rows[(rows < cols) & (weights > 0)], cols[(rows < cols) & (weights > 0)], strict=True):
            seen.setdefault((int(a), int(b)), None)
    pairs = np.array(list(seen), dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]
