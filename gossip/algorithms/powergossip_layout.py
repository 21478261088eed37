"""How PowerGossip lays out its work: the matrices it compresses, batched into groups of equal shape and role
(runs of strided views of the buckets), the classes of groups whose factors one call orthonormalises, each
edge's factors in one flat buffer per side (:class:`EdgeState`), and each edge's plan of one power iteration
(:class:`Plan`). The algorithm itself is in :mod:`gossip.algorithms.powergossip`.

Every dataclass here is built by keyword (``kw_only``): several have a dozen fields of one type, which a
positional call could swap without an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from gossip.algorithms.buckets import Entry
from gossip.backends.base import PlannedExchange


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """A compressed parameter: bucket index, entry, and its matrix shape (m, k).

    Attributes:
        bucket: the index of the bucket holding it.
        entry: where it lives in that bucket.
        m: its rows (the first dimension).
        k: its columns (the product of the other dimensions).
    """

    bucket: int
    entry: Entry
    m: int
    k: int


@dataclass(frozen=True, kw_only=True)
class Run:
    """``count`` matrices of one shape at ``offset``, ``offset + stride``, ... of one bucket: one strided view.

    Attributes:
        bucket: the index of the bucket.
        offset: the first matrix's first element in the bucket.
        stride: elements from one matrix to the next.
        count: the number of matrices.
    """

    bucket: int
    offset: int
    stride: int
    count: int


@dataclass(frozen=True, kw_only=True)
class Group:
    """Matrices of one shape (m, k) and one role, batched: their factors are orthonormalised in one call.

    ``members`` are indices into the algorithm's matrix list, in (bucket, offset) order; ``runs`` cover them in
    the same order, each a zero-copy (count, m, k) view of one bucket, so the products and the update take one
    ``bmm`` / ``baddbmm_`` per run (one per group when the layers share a bucket).

    Attributes:
        m: the matrices' rows.
        k: the matrices' columns.
        members: indices into the algorithm's matrix list.
        runs: the strided views that cover the members, in order.
    """

    m: int
    k: int
    members: tuple[int, ...]
    runs: tuple[Run, ...]


def group_matrices(matrices: list[Matrix]) -> list[Group]:
    """Batch ``matrices`` into groups of one shape and one role, without copying them.

    The role is the parameter name with its digits replaced (``blocks.3.mlp.fc.weight`` -> ``blocks.#.mlp.fc.
    weight``): in a stack of identical layers the same role sits at the same distance from one layer to the next,
    so the layers of a bucket form one run. A change of bucket or of spacing starts a new run of the same group.
    Groups are ordered by their first matrix, so every rank builds the same groups from the same model.

    Args:
        matrices: the compressed matrices, in (bucket, offset) order.

    Returns:
        The groups, ordered by their first matrix.
    """
    roles: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):
        roles.setdefault((matrix.m, matrix.k, re.sub(r"\d+", "#", matrix.entry.name)), []).append(index)
    groups: list[Group] = []
    for (m, k, _), members in roles.items():
        members = sorted(members, key=lambda i: (matrices[i].bucket, matrices[i].entry.offset))
        runs: list[list[int]] = []
        for index in members:
            run = runs[-1] if runs else []
            offsets = [matrices[i].entry.offset for i in run]
            fits = run and matrices[run[0]].bucket == matrices[index].bucket
            fits = fits and (len(run) == 1 or matrices[index].entry.offset - offsets[-1] == offsets[1] - offsets[0])
            if fits:
                run.append(index)
            else:
                runs.append([index])
        described = []
        for run in runs:
            offsets = [matrices[i].entry.offset for i in run]
            stride = offsets[1] - offsets[0] if len(run) > 1 else m * k
            described.append(Run(bucket=matrices[run[0]].bucket, offset=offsets[0], stride=stride, count=len(run)))
        groups.append(Group(m=m, k=k, members=tuple(members), runs=tuple(described)))
    return sorted(groups, key=lambda g: min(g.members))


PAD_RATIO = 4  # the default pad_ratio on CUDA
#: The default pad_ratio on the CPU: at PowerGossip's sizes one QR call costs more than its arithmetic on the
#: zeros of factors padded up to 8x (``benchmarks/powergossip_compute.py``), and the padding is stored, not copied.
CPU_PAD_RATIO = 8


def row_classes(rows: list[int], pad_ratio: int = PAD_RATIO) -> list[tuple[int, list[int]]]:
    """Groups whose factors (``rows[i]`` x r each) one batched call orthonormalises together.

    A class starts at the largest row count not yet taken and takes every group with at least 1/``pad_ratio`` of
    its rows; the smaller factors are zero-padded to the class's rows. Zero rows below the data change neither a
    column's norm nor an inner product, and stay zero (in Gram-Schmidt, and in Householder QR, whose reflectors
    are zero there), so the padded call computes the same factors (up to the rounding of the longer sums) with one
    kernel sequence per class instead of one per group; ``pad_ratio`` bounds the work spent on the zeros.
    Deterministic in ``rows``, so both ends of an edge build the same classes.

    Args:
        rows: each group's factor rows.
        pad_ratio: the largest ratio of rows within a class (1: only equal rows share a class).

    Returns:
        ``(padded rows, group indices)`` per class.
    """
    classes: list[tuple[int, list[int]]] = []
    for index in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        if classes and rows[index] * pad_ratio >= classes[-1][0]:
            classes[-1][1].append(index)
        else:
            classes.append((rows[index], [index]))
    return [(top, sorted(members)) for top, members in classes]


@dataclass(frozen=True, kw_only=True)
class RowClass:
    """Groups whose factors one batched call orthonormalises.

    Elements ``start:stop`` of a factor buffer, where each of them is stored padded to ``rows``.

    Attributes:
        rows: the largest factor's rows; the smaller ones are stored zero-padded to it.
        members: group indices, in buffer order.
        start: the class's first element in the factor buffer.
        stop: one past its last element.
    """

    rows: int  # the largest factor's rows; the smaller ones are stored zero-padded to it
    members: tuple[int, ...]  # group indices, in buffer order
    start: int
    stop: int


@dataclass(frozen=True, kw_only=True)
class Side:
    """Where each group's factors lie, for one side (p: m rows a factor, or q: k rows) at rank r.

    In a message, and in the flat buffer an edge keeps its factors in. The groups are ordered class by class
    (:func:`row_classes`) in both. A message holds each group's (count, r, rows) block, unpadded: it has the layout
    of the side its difference R replaces (a left multiplication sends (X^T p)^T, k rows a matrix, which becomes the
    next q^T; a right one sends (X q)^T, the next p^T). The factor buffer stores every factor of a class padded with
    zero rows to the class's rows, so that each class is one contiguous (count, r, class rows) block that one call
    orthonormalises in place; the factors are the views ``[..., :rows]`` of it.

    Attributes:
        rows: per group, m or k.
        offsets: per group, the start of its (count, r, rows) block in a message.
        numel: the elements of a message.
        stored_offsets: per group, the start of its (count, r, class rows) block in the factor buffer.
        stored_numel: the elements of the factor buffer.
        classes: the row classes, each ``start:stop`` in the factor buffer.
        positions: a message's elements' places in the factor buffer; None when no class pads and the two layouts
            are one.
        columns: the factor columns (rows of the stored transposes) of every group.
    """

    rows: list[int]  # per group: m or k
    offsets: list[int]  # per group: the start of its (count, r, rows) block in a message
    numel: int  # of a message
    stored_offsets: list[int]  # per group: the start of its (count, r, class rows) block in the factor buffer
    stored_numel: int
    classes: list[RowClass]  # start:stop in the factor buffer
    positions: torch.Tensor | None
    columns: int  # factor columns (rows of the stored transposes), of every group

    @classmethod
    def build(cls, groups: list[Group], rows: list[int], rank: int, pad_ratio: int, device: torch.device) -> Side:
        """Lay out ``groups``' factors of one side at ``rank``.

        Args:
            groups: the matrix groups.
            rows: each group's factor rows on this side (m for p, k for q).
            rank: the projection rank r.
            pad_ratio: see :func:`row_classes`.
            device: where ``positions`` lives.

        Returns:
            The layout.
        """
        offsets, stored_offsets, classes, positions = [0] * len(groups), [0] * len(groups), [], []
        position = stored = columns = 0
        for top, members in row_classes(rows, pad_ratio):
            start = stored
            for g in members:
                count = len(groups[g].members) * rank  # factor columns (rows of the stored transposes)
                offsets[g], stored_offsets[g] = position, stored
                positions.append((stored + torch.arange(count).unsqueeze(1) * top + torch.arange(rows[g])).flatten())
                position += count * rows[g]
                stored += count * top
                columns += count
            classes.append(RowClass(rows=top, members=tuple(members), start=start, stop=stored))
        index = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        padded = stored != position
        return cls(
            rows=rows,
            offsets=offsets,
            numel=position,
            stored_offsets=stored_offsets,
            stored_numel=stored,
            classes=classes,
            positions=index.to(device) if padded else None,
            columns=columns,
        )

    def stacks(self, flat: torch.Tensor, groups: list[Group], rank: int) -> list[torch.Tensor]:
        """Each group's (count, r, rows) block of the message ``flat``, a view.

        Args:
            flat: a message laid out as this side.
            groups: the matrix groups.
            rank: the projection rank r.

        Returns:
            One view per group.
        """
        return [
            flat[offset : offset + len(group.members) * rank * rows].view(len(group.members), rank, rows)
            for group, offset, rows in zip(groups, self.offsets, self.rows, strict=True)
        ]

    def stored_stacks(self, flat: torch.Tensor, groups: list[Group], rank: int) -> list[torch.Tensor]:
        """Each group's factors in the factor buffer ``flat``: (count, r, rows) views of its padded block.

        Args:
            flat: a factor buffer laid out as this side.
            groups: the matrix groups.
            rank: the projection rank r.

        Returns:
            One view per group.
        """
        top = {g: c.rows for c in self.classes for g in c.members}
        return [
            flat[offset : offset + len(group.members) * rank * top[g]].view(len(group.members), rank, top[g])[
                ..., : self.rows[g]
            ]
            for g, (group, offset) in enumerate(zip(groups, self.stored_offsets, strict=True))
        ]

    def column_blocks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each class's factors in the factor buffer ``flat`` as one (factor columns, class rows) view.

        A row per factor column (the factors are stored transposed).

        Args:
            flat: a factor buffer laid out as this side.

        Returns:
            One view per class.
        """
        return [flat[c.start : c.stop].view(-1, c.rows) for c in self.classes]

    def blocks(self, flat: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Each class's factors in the factor buffer ``flat`` as one (count, rows, r) column-major view.

        Args:
            flat: a factor buffer laid out as this side.
            rank: the projection rank r.

        Returns:
            One view per class.
        """
        return [flat[c.start : c.stop].view(-1, rank, c.rows).mT for c in self.classes]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Both sides' layouts at rank r.

    Attributes:
        rank: the projection rank r.
        p: the layout of the p factors (m rows each).
        q: the layout of the q factors (k rows each).
    """

    rank: int
    p: Side
    q: Side


class EdgeState:
    """Warm factors and the parity counter of one unordered pair, identical on both of its ends.

    The factors are stored transposed, in one flat buffer per side laid out as :class:`Side` says:
    ``pt_stacks[g]`` is the (count, r, m) view of group g's p^T, rows contiguous (so the products are q^T X^T
    and p^T X, whose small dimension r comes first, see the module docstring; and a column of p is a contiguous
    row), padded with zeros to its class's rows.
    They change in place, so these views and the plans built on them (``plans``, see :class:`Plan`) stay valid
    from step to step. ``p`` and ``q`` give the factors per matrix as m x r and k x r (views, in matrix order)
    for inspection and checkpoints.

    Args:
        groups: the matrix groups.
        layout: both sides' layouts.
        generator: the pair-seeded generator that draws new factor columns.
        iteration: the edge's power-iteration counter (its parity picks the side).
        p: per matrix, its m x r factor.
        q: per matrix, its k x r factor.
        dtype: the factors' dtype.
        device: the factors' device.
    """

    __slots__ = ("generator", "iteration", "p_flat", "plans", "pt_stacks", "q_flat", "qt_stacks", "slots")

    def __init__(
        self,
        *,
        groups: list[Group],
        layout: Layout,
        generator: torch.Generator,
        iteration: int,
        p: list[torch.Tensor],
        q: list[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.generator, self.iteration = generator, iteration
        where = {i: (g, s) for g, group in enumerate(groups) for s, i in enumerate(group.members)}
        self.slots = [where[i] for i in range(len(where))]  # matrix index -> (group, position in the group)
        self.set_factors(groups, layout, p, q, dtype, device)

    @classmethod
    def fresh(
        cls,
        *,
        seed: int,
        matrices: list[Matrix],
        groups: list[Group],
        layout: Layout,
        device: torch.device,
        dtype: torch.dtype,
    ) -> EdgeState:
        """Factors drawn from the pair-seeded generator: p then q, matrix by matrix (part of the protocol).

        Args:
            seed: the pair's seed (the same on both ends).
            matrices: the compressed matrices, in order.
            groups: the matrix groups.
            layout: both sides' layouts.
            device: the factors' device.
            dtype: the factors' dtype.

        Returns:
            The edge's state at iteration 0.
        """
        generator = torch.Generator().manual_seed(seed)
        p, q = [], []
        for matrix in matrices:
            p.append(torch.randn(matrix.m, layout.rank, generator=generator, dtype=dtype).to(device))
            q.append(torch.randn(matrix.k, layout.rank, generator=generator, dtype=dtype).to(device))
        return cls(groups=groups, layout=layout, generator=generator, iteration=0, p=p, q=q, dtype=dtype, device=device)

    def draw(self, rows: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A new (rows, rank) block from the pair-seeded generator (the same on both ends when drawn alike).

        Args:
            rows: its rows.
            rank: its columns.
            device: where it goes.
            dtype: its dtype.

        Returns:
            A standard normal tensor.
        """
        return torch.randn(rows, rank, generator=self.generator, dtype=dtype).to(device)

    def set_factors(
        self,
        groups: list[Group],
        layout: Layout,
        p: list[torch.Tensor],
        q: list[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Replace the factors from per-matrix lists (matrix order; m x r and k x r), laid out as ``layout``.

        Args:
            groups: the matrix groups.
            layout: both sides' layouts.
            p: per matrix, its m x r factor.
            q: per matrix, its k x r factor.
            dtype: the factors' dtype.
            device: the factors' device.
        """
        self.p_flat = torch.zeros(layout.p.stored_numel, dtype=dtype, device=device)  # zero: the padding
        self.q_flat = torch.zeros(layout.q.stored_numel, dtype=dtype, device=device)
        self.pt_stacks = layout.p.stored_stacks(self.p_flat, groups, layout.rank)
        self.qt_stacks = layout.q.stored_stacks(self.q_flat, groups, layout.rank)
        for i, (g, s) in enumerate(self.slots):
            self.pt_stacks[g][s].copy_(p[i].mT)
            self.qt_stacks[g][s].copy_(q[i].mT)
        # per (right multiplication?, carries the uncompressed tensors?): built on first use
        self.plans: dict[tuple[bool, bool], Plan] = {}

    def _unstack(self, stacks: list[torch.Tensor]) -> list[torch.Tensor]:
        return [stacks[g][s].mT for g, s in self.slots]

    @property
    def p(self) -> list[torch.Tensor]:
        """Per matrix, its m x r factor p (views of the factor buffer, in matrix order)."""
        return self._unstack(self.pt_stacks)

    @property
    def q(self) -> list[torch.Tensor]:
        """Per matrix, its k x r factor q (views of the factor buffer, in matrix order)."""
        return self._unstack(self.qt_stacks)


@dataclass(frozen=True, kw_only=True)
class Replacement:
    """Where a plan's R goes, planned once.

    R arrives in the message layout; ``incoming`` holds it in the layout of the factor buffer it replaces
    (zero-padded: a buffer of its own, whose padding stays zero; the message itself when no class pads), where each
    factor column is a row of a class's block, so that one reduction per class sums every column (for the warm-start
    rule, PowerGossip's step 4, and the check for non-finite input), read on the host with the received uncompressed
    tensors' sum in one transfer.

    Attributes:
        flat: the factor buffer R replaces.
        incoming: R laid out as ``flat``.
        stored: per group, its factors' views in ``incoming`` (empty when ``incoming`` is R).
        sources: per group, R's (count, r, rows) view in the message.
        blocks: per class, incoming's and flat's (factor columns, class rows) blocks, and its columns' places in
            ``sums``.
        sums: the factor columns' sums in R, then the received uncompressed tensors' sum (when the plan's message
            carries them).
        exact_sum: the 0-dim view of that last sum.
        columns: the number of factor columns.
    """

    flat: torch.Tensor  # the factor buffer R replaces
    incoming: torch.Tensor  # R laid out as ``flat``
    stored: list[torch.Tensor]  # per group: its factors' views in ``incoming`` (empty when ``incoming`` is R)
    sources: list[torch.Tensor]  # per group: R's (count, r, rows) view in the message
    # per class: incoming's and flat's (factor columns, class rows) blocks, and its columns' places in ``sums``
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # the factor columns' sums in R, then the received uncompressed tensors' sum (when the plan's message carries
    # them), whose 0-dim view is ``exact_sum``
    sums: torch.Tensor
    exact_sum: torch.Tensor
    columns: int  # the number of factor columns


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One side of one edge's power iteration, built once: its messages and the views every operation reads.

    So an iteration runs its kernels without cutting a tensor (on a GPU each view would be an operation too).
    A right multiplication orthonormalises q and sends (X q)^T = q^T X^T; R replaces p. A left one
    orthonormalises p and sends (X^T p)^T = p^T X; R replaces q. The message is the products in the layout of
    the side R replaces, then, in a plan that carries them, the uncompressed tensors packed (else ``sent_exact``
    and ``received_exact`` are empty); the difference R is computed into the received message in place. With a
    message dtype narrower than the parameters' (``PowerGossip(message_dtype=...)``), the products are taken in
    the parameters' dtype into ``difference``, rounded into ``sent_products``, and travel as a tensor of their own
    before the pack (which keeps the parameters' dtype); R is then computed from the two rounded products into
    ``difference`` (``rounded``).

    Attributes:
        messages: what is sent to the peer: one message, or with a message dtype other than the parameters', the
            products and the uncompressed pack.
        inboxes: the receive buffers, laid out as ``messages``.
        sent_products: the products as sent, in the message dtype.
        received_products: the products as received, in the message dtype.
        difference: R = a_hi - a_lo in the parameters' dtype: ``received_products`` itself, or a buffer.
        rounded: whether the products travel in a dtype other than the parameters' (R computed into a buffer).
        sent_exact: the uncompressed tensors sent, packed.
        sent_exact_parts: each uncompressed tensor's view in ``sent_exact``.
        received_exact: the uncompressed tensors received, packed.
        products: per run, (factor^T, X^T or X, out) of its batched product.
        updates: per run, (X, p, q^T) for X += alpha p q^T.
        factor: the factor this side orthonormalises, per group, as (count, r, rows) views.
        classes: per class, the (count, rows, r) column-major view of its padded block and a (count, r, r) buffer
            for QR's triangular factor.
        replaced: the factor R replaces, and the buffers of the warm-start rule.
        exchange: the messages to the edge's peer and the inboxes, checked once.
        graphs: this plan's kernel sequences captured as CUDA graphs, by name
            (:class:`gossip.algorithms.cuda_graphs.CapturedKernels`); they live and die with the plan.
    """

    messages: list[torch.Tensor]  # what is sent to the peer, and the receive buffers: one message, or with a
    inboxes: list[torch.Tensor]  # message dtype other than the parameters', the products and the uncompressed pack
    sent_products: torch.Tensor  # the products as sent and as received, in the message dtype
    received_products: torch.Tensor
    difference: torch.Tensor  # R = a_hi - a_lo in the parameters' dtype: received_products itself, or a buffer
    rounded: bool  # whether the products travel in a dtype other than the parameters' (R computed into a buffer)
    sent_exact: torch.Tensor  # the uncompressed tensors: the pack, and each tensor in it
    sent_exact_parts: list[torch.Tensor]
    received_exact: torch.Tensor
    products: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per run: (factor^T, X^T or X, out)
    updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per run: (X, p, q^T) for X += alpha p q^T
    # The factor this side orthonormalises: its group views (count, r, rows) and, per class, the (count, rows, r)
    # column-major view of its padded block and a (count, r, r) buffer for QR's triangular factor.
    factor: list[torch.Tensor]
    classes: list[tuple[torch.Tensor, torch.Tensor]]
    replaced: Replacement  # the factor R replaces, and the buffers of the warm-start rule
    exchange: PlannedExchange  # the messages to the edge's peer and the inboxes, checked once
    graphs: dict = field(default_factory=dict)  # its kernel sequences as CUDA graphs (cuda_graphs.CapturedKernels)
