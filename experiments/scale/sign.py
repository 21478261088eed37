"""ChocoSign over the replica axis: scaled-sign codes of many rows at once, and the public copies per directed edge.

:func:`sign_values` is what :meth:`gossip.algorithms.scaled_sign.SignCodec.encode` returns as its second value (the
decoded message, which the library guarantees equal on both ends) for every row of a ``(rows, numel)`` tensor: the
same operations in the same order on a ``(rows, chunks, chunk)`` grid instead of ``(chunks, chunk)``, the chunk sums
reduced over the same contiguous 256 (or ``chunk``) values, the last chunk's real entries counted as the library
counts them. It is a transcription, not an import, because the library's codec takes one flat tensor whose last
chunk is its only partial one (a test pins it bit for bit to the library's codec, row by row). Nothing is packed:
no bytes travel, their count comes from the message layout (:func:`message_bytes`).

:class:`BatchedChocoSign` is :class:`gossip.ChocoSign` (CHOCO-Gossip, Koloskova et al. 2019, Alg. 1) for all ranks.
For an edge (i, j), rank i keeps :math:`\\hat x_{i|j}` (its buffer as j knows it) and :math:`\\hat x_{j|i}` (j's as
it knows it), and j keeps the same two; both ends add the same decoded message to a copy, so i's
:math:`\\hat x_{i|j}` and j's are bit-identical (what the library guarantees). Here that copy is stored once: a row
per directed edge i -> j holds :math:`\\hat x_{i|j}`, and rank i's correction from j is ``row(j -> i) - row(i -> j)``.
Codes are per library bucket (a row's segments).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from experiments.scale.steps import StepPlan
from gossip.algorithms.scaled_sign import check_levels

CPU_BLOCK = 1 << 18  # values coded at a time on the CPU
DEVICE_BLOCK = 1 << 26  # and on an accelerator


def _means(sums: list[Tensor], counts: list[Tensor]) -> Tensor:
    """(rows, chunks, groups) float32: each group's mean magnitude per chunk (0 where it has none)."""
    return torch.stack([(total / n.clamp(min=1)).float() for total, n in zip(sums, counts, strict=True)], dim=-1)


def sign_values(residual: Tensor, chunk: int, levels: int) -> Tensor:
    """The scaled-sign code's decoded values of every row of ``residual`` (module docstring), float32.

    Args:
        residual: (rows, numel) values to compress, each row coded alone.
        chunk: values per scale.
        levels: magnitudes per chunk, 1, 2 or 4.

    Returns:
        (rows, numel): the values :meth:`SignCodec.encode` returns for each row.
    """
    check_levels("sign_values", levels)
    rows, numel = residual.shape
    dtype, device = residual.dtype, residual.device
    chunks = max(1, math.ceil(numel / chunk))
    tail = numel - (chunks - 1) * chunk
    members = torch.full((chunks,), float(chunk), dtype=dtype, device=device)
    members[-1] = tail
    magnitudes = torch.zeros(rows, chunks, chunk, dtype=dtype, device=device)
    torch.abs(residual, out=magnitudes.view(rows, -1)[:, :numel])
    sums, counts = [magnitudes.sum(dim=-1)], [members]
    up = split = None
    if levels >= 2:  # the chunk's magnitudes split at their mean; the flags are 0/1 in the residual's dtype
        up = torch.ge(magnitudes, _means(sums, counts).to(dtype), out=torch.empty_like(magnitudes))
        up[:, -1, tail:] = 0
        high = up.sum(dim=-1)
        upper_part = magnitudes * up  # the magnitudes on the upper half, 0 elsewhere
        lower_part = magnitudes - upper_part
        sums = [lower_part.sum(dim=-1), upper_part.sum(dim=-1)]
        counts = [counts[0] - high, high]
    if levels == 4:  # each half split at its own mean
        means = _means(sums, counts).to(dtype)
        split = torch.ge(magnitudes, means[..., 1:], out=torch.empty_like(magnitudes)).mul_(up)
        below = torch.ge(magnitudes, means[..., :1], out=torch.empty_like(magnitudes))
        split.add_(torch.gt(below, up, out=below))  # the lower half's entries at or above its mean
        split[:, -1, tail:] = 0
        seconds = split.sum(dim=-1)
        top = up * split  # group 3
        high = top.sum(dim=-1)
        top_sum = top.mul_(magnitudes).sum(dim=-1)
        upper_part.sub_(top)  # group 2
        lower_high = lower_part * split  # group 1
        lower_part.sub_(lower_high)  # group 0
        sums = [lower_part.sum(dim=-1), lower_high.sum(dim=-1), upper_part.sum(dim=-1), top_sum]
        counts = [counts[0] - (seconds - high), seconds - high, counts[1] - high, high]
    scales = _means(sums, counts)  # (rows, chunks, levels)
    if levels == 1:
        values = scales.expand(-1, -1, chunk)
    else:
        groups = up.bool().view(torch.uint8)
        if levels == 4:
            groups = groups * 2 + split.bool().view(torch.uint8)
        values = scales.gather(-1, groups.long())
    sign = torch.ge(residual, 0, out=torch.empty(residual.shape, dtype=torch.float32, device=device))
    return values.reshape(rows, -1)[:, :numel] * sign.mul_(2).sub_(1)


def directed_edges(plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    """Step t's messages as directed edges, in the order every rank's in-peers are listed, slot by slot.

    Args:
        plan: W(t).

    Returns:
        (senders, receivers): rank i codes its residual for each in-peer j.
    """
    src = np.concatenate(plan.active)
    dst = np.concatenate([slot.peers[nodes] for slot, nodes in zip(plan.slots, plan.active, strict=True)])
    return src, dst


def message_bytes(numel: int, chunk: int, levels: int) -> int:
    """The payload bytes of one scaled-sign message of ``numel`` values (signs, scales, split bitplanes).

    Args:
        numel: the values coded.
        chunk: values per scale.
        levels: magnitudes per chunk.

    Returns:
        ``ceil(numel / 8) (1 + log2 levels) + 4 chunks levels``.
    """
    chunks = max(1, math.ceil(numel / chunk))
    return math.ceil(numel / 8) * (1 + int(math.log2(levels))) + 4 * chunks * levels


class BatchedChocoSign:
    """:class:`gossip.ChocoSign` for all ranks at once (module docstring).

    Args:
        segments: (start, numel) of each library bucket within a row (each coded on its own).
        gamma: the consensus step size.
        chunk: values per scale.
        levels: magnitudes per chunk.
        block_rows: rows coded at a time (bounds the codec's work buffers); None: about ``CPU_BLOCK`` values at a
            time on the CPU, where a block that stays in the caches is several times faster, ``DEVICE_BLOCK``
            elsewhere, where fewer, larger kernels are.
    """

    def __init__(
        self, segments: list[tuple[int, int]], gamma: float = 1.0, chunk: int = 256, levels: int = 4,
        block_rows: int | None = None,
    ):  # fmt: skip
        self.segments, self.gamma, self.chunk = segments, float(gamma), chunk
        self.levels, self.block_rows = check_levels("BatchedChocoSign", levels), block_rows
        self.rows: dict[tuple[int, int], int] = {}  # directed edge (i, j) -> row of ``public``: x-hat_{i|j}
        self.public: Tensor | None = None
        self._work: tuple[Tensor, Tensor, Tensor] | None = None  # a step's residuals, values and corrections
        self.bytes_per_message = sum(message_bytes(numel, chunk, levels) for _, numel in segments)

    def reserve(self, src: np.ndarray, dst: np.ndarray, like: Tensor) -> None:
        """Create the public rows of the directed edges src -> dst at once (at 0), instead of as they are met.

        Args:
            src: the edges' senders.
            dst: their receivers.
            like: a tensor whose dtype, device and row length the rows take.
        """
        self._rows_of(src, dst, like)

    def _rows_of(self, src: np.ndarray, dst: np.ndarray, like: Tensor) -> np.ndarray:
        """The public rows of the directed edges src -> dst, created at 0 on first use."""
        new = [(int(a), int(b)) for a, b in zip(src, dst, strict=True) if (int(a), int(b)) not in self.rows]
        if new:
            start = 0 if self.public is None else self.public.shape[0]
            zeros = like.new_zeros(len(new), like.shape[1])
            self.public = zeros if self.public is None else torch.cat([self.public, zeros])
            self.rows.update({edge: start + i for i, edge in enumerate(new)})
        return np.array([self.rows[int(a), int(b)] for a, b in zip(src, dst, strict=True)], dtype=np.int64)

    def _buffers(self, rows: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(residuals, values, corrections) of ``rows`` rows like ``like``'s, kept from step to step: a fresh tensor
        of n rows is a fresh mapping of memory on the CPU, whose first touch costs more than the arithmetic."""
        shape = (rows, like.shape[1])
        work = self._work
        if work is None or work[0].shape != shape or work[0].dtype != like.dtype or work[0].device != like.device:
            values = torch.empty(shape, dtype=torch.float32, device=like.device)
            work = self._work = (like.new_empty(shape), values, like.new_empty(shape))
        return work

    def encode(self, residual: Tensor, out: Tensor | None = None) -> Tensor:
        """Each row's decoded message, bucket by bucket and ``block_rows`` rows at a time.

        Args:
            residual: (rows, P) residuals.
            out: a float32 (rows, P) tensor to write the values into; None: a new one.

        Returns:
            (rows, P) float32 values (``out`` when given).
        """
        values = torch.empty(residual.shape, dtype=torch.float32, device=residual.device) if out is None else out
        rows = self.block_rows
        if rows is None:
            rows = max(1, (CPU_BLOCK if residual.device.type == "cpu" else DEVICE_BLOCK) // residual.shape[1])
        for first in range(0, residual.shape[0], rows):
            block = slice(first, first + rows)
            for start, numel in self.segments:
                columns = slice(start, start + numel)
                values[block, columns] = sign_values(residual[block, columns], self.chunk, self.levels)
        return values

    @torch.no_grad()
    def mix_(self, y: Tensor, plan: StepPlan) -> int:
        """One ChocoSign step on the trackers ``y`` (n, P) in place.

        Every rank codes its residual to each in-peer from its buffer as it was at the start of the step, both
        ends add each message to the public copy it updates, then each rank adds ``gamma w (copy(j -> i) -
        copy(i -> j))`` for its in-peers in the schedule's order.

        Args:
            y: the buffers, one row per rank.
            plan: W(t) (symmetric).

        Returns:
            The payload bytes every rank sent this step, summed over the ranks.
        """
        if not plan.slots:
            return 0
        src, dst = directed_edges(plan)
        mine, theirs = self._rows_of(src, dst, y), self._rows_of(dst, src, y)
        device = y.device
        theirs_t, src_t = torch.as_tensor(theirs, device=device), torch.as_tensor(src, device=device)
        if np.array_equal(mine, np.arange(mine[0], mine[0] + len(mine))):  # reserved in this order: a view
            public_mine, mine_t = self.public[mine[0] : mine[0] + len(mine)], None
        else:
            mine_t = torch.as_tensor(mine, device=device)
            public_mine = self.public[mine_t]
        identity = len(src) == plan.n and np.array_equal(src, np.arange(plan.n))
        residuals, values, corrections = self._buffers(len(src), y)
        if identity:
            torch.sub(y, public_mine, out=residuals)
        else:
            torch.index_select(y, 0, src_t, out=residuals).sub_(public_mine)
        values = self.encode(residuals, out=values)
        if mine_t is None:
            public_mine += values
        else:  # every directed edge once a step: no index repeats, one addition per element
            self.public.index_add_(0, mine_t, values)
            public_mine = self.public[mine_t]
        first = 0
        for slot, nodes in zip(plan.slots, plan.active, strict=True):
            count = len(nodes)
            here = slice(first, first + count)
            correction = torch.index_select(self.public, 0, theirs_t[here], out=corrections[:count])
            correction.sub_(public_mine[here])
            weights = slot.weights[nodes]
            if identity and count == plan.n and (weights == weights[0]).all():
                y.add_(correction, alpha=self.gamma * float(weights[0]))
            else:
                for weight in np.unique(weights):
                    take = torch.as_tensor(np.flatnonzero(weights == weight), device=device)
                    who = src_t[here][take]
                    part = y[who]
                    part.add_(correction[take], alpha=self.gamma * float(weight))
                    y[who] = part
            first += count
        return len(src) * self.bytes_per_message
