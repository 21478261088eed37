"""PowerGossip over the replica axis: every edge's power iterations of a step as batched products and updates.

:class:`BatchedPowerGossip` runs :class:`gossip.PowerGossip`'s step (the math: gossip/algorithms/powergossip.py) for
all edges of W(t) at once, and takes from the library everything that is not a batched loop:

* the settings and the choice of compressed matrices: a library :class:`gossip.PowerGossip` instance (its
  ``_compress`` rule, ``min_compression``, ``policy``), its groups (:func:`group_matrices`) and its padded factor
  layout (:class:`gossip.algorithms.powergossip_layout.Side`, the library's pad ratio for the device);
* each edge's initial factors: :meth:`EdgeState.fresh` with the pair's seed ``seed n^2 + lo n + hi``, kept per edge
  (a row of :attr:`BatchedPowerGossip.p_store` / ``q_store``, laid out as the library's factor buffers) with the
  edge's own iteration counter, whose parity picks the side (a right multiplication orthonormalises q and replaces
  p by R, a left one the converse);
* the orthonormalisation, :func:`gossip.algorithms.powergossip_factors.orthonormalize_` on each class block of the
  stored factors (QR on the CPU, Gram-Schmidt elsewhere, as the library chooses), and the warm-start rule (a column
  of R that is zero throughout keeps the previous factor's column).

One iteration: the uncompressed tensors (vectors, small matrices) are mixed as exact gossip in the step's first
iteration (:func:`experiments.scale.mixing.exact_gossip_` on their columns); each end's products ``q^T X^T`` (right)
or ``p^T X`` (left) are one ``bmm`` per matrix over the edges, rounded to the message dtype when one is set;
R = a_hi - a_lo in the parameters' dtype; then every rank applies its edges' corrections ``X += +-gamma w R q^T`` (or
``p R^T``) with ``baddbmm_``, its in-peers in the schedule's order, the low end adding and the high end subtracting,
all from the products of the rows as they were when the iteration began. The products and updates are the library's
kernels on the same operand layouts (a factor's rows at the padded class stride, a matrix at the row stride), batched
over edges instead of over a group's layers: on the CPU both run the same per-matrix BLAS calls, and the tests find
the trajectories bit for bit equal.

Not covered: ``delayed_last_iteration``, ``warm_start=False`` and the non-finite policies (a NaN here is simply
propagated); the bytes are counted from the message layout, as the communicator counts a payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from experiments.scale.mixing import exact_gossip_
from experiments.scale.replicas import Replicas
from experiments.scale.steps import StepPlan
from gossip import PowerGossip
from gossip.algorithms.buckets import Entry
from gossip.algorithms.powergossip_factors import default_method, orthonormalize_
from gossip.algorithms.powergossip_layout import (
    CPU_PAD_RATIO,
    PAD_RATIO,
    EdgeState,
    Layout,
    Matrix,
    Side,
    group_matrices,
)


@dataclass(frozen=True)
class _Placed:
    """A compressed matrix: where it lies in a row and where its factors lie in each side's stored layout."""

    offset: int
    m: int
    k: int
    p_offset: int  # its p^T (r x m) at this offset of a p row, rows at stride p_top
    p_top: int
    q_offset: int
    q_top: int


def _exact_runs(entries: list[tuple[int, int]]) -> list[slice]:
    """Column slices of consecutive (offset, numel) entries, merged where they touch."""
    runs: list[list[int]] = []
    for offset, numel in entries:
        if runs and runs[-1][1] == offset:
            runs[-1][1] += numel
        else:
            runs.append([offset, offset + numel])
    return [slice(a, b) for a, b in runs]


class BatchedPowerGossip:
    """:class:`gossip.PowerGossip` for all ranks at once (module docstring).

    Args:
        replicas: the replicas whose rows it mixes (their layout and device).
        n: the number of ranks (the pair seeds depend on it).
        algorithm: an unbound library PowerGossip whose settings it runs.

    Raises:
        NotImplementedError: ``delayed_last_iteration`` or ``warm_start=False``.
    """

    def __init__(self, replicas: Replicas, n: int, algorithm: PowerGossip):
        if algorithm.delayed_last_iteration or not algorithm.warm_start:
            raise NotImplementedError("BatchedPowerGossip: delayed_last_iteration and warm_start=False are not batched")
        self.algorithm, self.n, self.rank = algorithm, n, algorithm.matrix_rank
        self.dtype, self.device = replicas.dtype, replicas.device
        message = algorithm.message_dtype
        self.message_dtype = None if message in (None, self.dtype) else message
        self.matrices: list[Matrix] = []  # as the library lists them (bucket-local entries)
        where: list[int] = []  # each matrix's offset in a row
        exact: list[tuple[int, int]] = []
        for bucket, (start, numel) in enumerate(replicas.segments):
            for entry in replicas.entries:
                if not start <= entry.offset < start + numel:
                    continue
                local = Entry(entry.name, entry.offset - start, entry.shape)
                if algorithm._compress(local):  # the library's rule (min_compression, policy)
                    m, k = entry.shape[0], entry.numel // entry.shape[0]
                    self.matrices.append(Matrix(bucket=bucket, entry=local, m=m, k=k))
                    where.append(entry.offset)
                elif entry.numel:
                    exact.append((entry.offset, entry.numel))
        self.exact_columns = _exact_runs(exact)
        self.exact_numel = sum(numel for _, numel in exact)
        self.groups = group_matrices(self.matrices)
        pad = algorithm.tuning.pad_ratio or (PAD_RATIO if self.device.type == "cuda" else CPU_PAD_RATIO)
        r = self.rank
        p_side = Side.build(self.groups, [g.m for g in self.groups], r, pad, self.device)
        q_side = Side.build(self.groups, [g.k for g in self.groups], r, pad, self.device)
        self.layout = Layout(rank=r, p=p_side, q=q_side)
        self.method = algorithm.tuning.orthonormalization or default_method(self.device)
        slot = {i: (g, s) for g, group in enumerate(self.groups) for s, i in enumerate(group.members)}
        tops = [{g: c.rows for c in side.classes for g in c.members} for side in (p_side, q_side)]
        self.placed = []
        for i, matrix in enumerate(self.matrices):
            g, s = slot[i]
            p_top, q_top = tops[0][g], tops[1][g]
            self.placed.append(_Placed(where[i], matrix.m, matrix.k, p_side.stored_offsets[g] + s * r * p_top, p_top,
                                       q_side.stored_offsets[g] + s * r * q_top, q_top))  # fmt: skip
        self.edges: dict[tuple[int, int], int] = {}  # (lo, hi) -> row of the stores
        self.p_store = torch.zeros(0, p_side.stored_numel, dtype=self.dtype, device=self.device)
        self.q_store = torch.zeros(0, q_side.stored_numel, dtype=self.dtype, device=self.device)
        self.iteration = np.zeros(0, dtype=np.int64)
        element = torch.empty(0, dtype=self.message_dtype or self.dtype).element_size()
        self.product_bytes = {True: p_side.numel * element, False: q_side.numel * element}  # by side (right?)
        self.exact_bytes = self.exact_numel * torch.empty(0, dtype=self.dtype).element_size()

    # -- per-edge state ------------------------------------------------------------------------------------
    def edge_rows(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The store rows of the edges (lo, hi), each created on first use from the library's pair-seeded draw.

        Args:
            lo: the edges' low ends.
            hi: their high ends.

        Returns:
            The rows, int64.
        """
        new = [(int(a), int(b)) for a, b in zip(lo, hi, strict=True) if (int(a), int(b)) not in self.edges]
        if new:
            n, start = self.n, len(self.iteration)
            fresh = [
                EdgeState.fresh(seed=self.algorithm.seed * n * n + a * n + b, matrices=self.matrices,
                                groups=self.groups, layout=self.layout, device=self.device, dtype=self.dtype)
                for a, b in new
            ]  # fmt: skip
            self.p_store = torch.cat([self.p_store, torch.stack([e.p_flat for e in fresh])])
            self.q_store = torch.cat([self.q_store, torch.stack([e.q_flat for e in fresh])])
            self.iteration = np.concatenate([self.iteration, np.zeros(len(new), dtype=np.int64)])
            self.edges.update({pair: start + i for i, pair in enumerate(new)})
        return np.array([self.edges[int(a), int(b)] for a, b in zip(lo, hi, strict=True)], dtype=np.int64)

    def _view(self, flat: Tensor, offset: int, top: int, rows: int) -> Tensor:
        """(E, r, rows) views of one matrix's transposed factor in stored factor rows ``flat`` (E, stored)."""
        return flat[:, offset : offset + self.rank * top].view(-1, self.rank, top)[..., :rows]

    # -- one step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def mix_(self, rows: Tensor, plan: StepPlan) -> int:
        """Step t's power iterations on ``rows`` (n, P) in place, over the edges of ``plan``.

        Args:
            rows: the replicas.
            plan: W(t) (symmetric).

        Returns:
            The payload bytes every rank sent this step, summed over the ranks.
        """
        if not len(plan.lo):
            return 0
        ids = self.edge_rows(plan.lo, plan.hi)
        sent = 0
        gamma = self.algorithm.gamma
        every = self.algorithm.tuning.uncompressed_every_iteration
        for iteration in range(self.algorithm.num_iterations):
            exact = bool(self.exact_numel) and (iteration == 0 or every)
            if exact:
                exact_gossip_(rows, plan, gamma, self.exact_columns)
            rights = self.iteration[ids] % 2 == 1
            rounds = [self._products(rows, plan, ids, np.flatnonzero(rights == r), r) for r in (False, True)]
            for k in range(len(plan.slots)):
                self._update_slot(rows, plan, k, rounds, rights, gamma)
                nodes = plan.active[k]
                sides = rights[plan.slot_edges[k][nodes]]
                sent += int(sides.sum()) * self.product_bytes[True] + int((~sides).sum()) * self.product_bytes[False]
                sent += len(nodes) * self.exact_bytes * exact
            for right, chosen, factors, differences in rounds:
                if len(chosen):
                    self._replace(ids[chosen], right, factors, differences)
            self.iteration[ids] += 1
        return sent

    def _products(self, rows: Tensor, plan: StepPlan, ids: np.ndarray, chosen: np.ndarray, right: bool) -> tuple:
        """Orthonormalise the chosen edges' factor of this side and compute R per matrix from both ends' products.

        Returns ``(right, chosen, orthonormalised factor rows, [R per matrix])``."""
        if not len(chosen):
            return right, chosen, None, []
        side = self.layout.q if right else self.layout.p
        store = self.q_store if right else self.p_store
        index = torch.as_tensor(ids[chosen], device=self.device)
        factors = store[index]
        for c in side.classes:
            block = factors[:, c.start : c.stop].view(len(chosen), -1, self.rank, c.rows).mT
            orthonormalize_(block, dtype=self.algorithm.tuning.orthonormalize_dtype, method=self.method)
        ends = [rows[torch.as_tensor(end[chosen], device=self.device)] for end in (plan.lo, plan.hi)]
        differences = []
        for placed in self.placed:
            m, k = placed.m, placed.k
            if right:
                factor = self._view(factors, placed.q_offset, placed.q_top, k)
            else:
                factor = self._view(factors, placed.p_offset, placed.p_top, m)
            products = []
            for end in ends:
                x = end[:, placed.offset : placed.offset + m * k].view(-1, m, k)
                product = torch.bmm(factor, x.mT if right else x)
                products.append(product if self.message_dtype is None else product.to(self.message_dtype))
            low, high = products
            differences.append(high.to(self.dtype) - low.to(self.dtype))  # widened exactly, subtracted in the dtype
        return right, chosen, factors, differences

    def _update_slot(self, rows: Tensor, plan: StepPlan, k: int, rounds: list, rights: np.ndarray, gamma: float):
        """Every rank's correction from its k-th in-peer's edge, one gather and one scatter per (side, alpha)."""
        nodes = plan.active[k]
        edges = plan.slot_edges[k][nodes]
        weights = plan.slots[k].weights[nodes]
        for right, chosen, factors, differences in rounds:
            if not len(chosen):
                continue
            position = np.full(len(plan.lo), -1)
            position[chosen] = np.arange(len(chosen))
            here = rights[edges] == right
            alphas = np.where(nodes == plan.lo[edges], 1.0, -1.0) * gamma * weights  # the low end adds
            for alpha in np.unique(alphas[here]):
                take = here & (alphas == alpha)
                who = torch.as_tensor(nodes[take], device=self.device)
                at = torch.as_tensor(position[edges[take]], device=self.device)
                block, chosen_factors = rows[who], factors[at]
                for placed, difference in zip(self.placed, differences, strict=True):
                    m, cols = placed.m, placed.k
                    x = block[:, placed.offset : placed.offset + m * cols].view(-1, m, cols)
                    r_ = difference[at]
                    if right:  # X += alpha R^T q^T (R is the next p^T)
                        qt = self._view(chosen_factors, placed.q_offset, placed.q_top, cols)
                        x.baddbmm_(r_.mT, qt, alpha=float(alpha))
                    else:  # X += alpha p R (R is the next q^T)
                        pt = self._view(chosen_factors, placed.p_offset, placed.p_top, m)
                        x.baddbmm_(pt.mT, r_, alpha=float(alpha))
                rows[who] = block

    def _replace(self, ids: np.ndarray, right: bool, factors: Tensor, differences: list[Tensor]) -> None:
        """Store the orthonormalised factors, and R in place of the other side's (but its zero columns)."""
        index = torch.as_tensor(ids, device=self.device)
        (self.q_store if right else self.p_store)[index] = factors
        store = self.p_store if right else self.q_store
        replaced = store[index]
        for placed, difference in zip(self.placed, differences, strict=True):
            if right:
                old = self._view(replaced, placed.p_offset, placed.p_top, placed.m)
            else:
                old = self._view(replaced, placed.q_offset, placed.q_top, placed.k)
            old.copy_(torch.where(difference.abs().amax(dim=-1, keepdim=True) > 0, difference, old))
        store[index] = replaced
