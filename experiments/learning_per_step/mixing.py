"""Mixing rules of the learning-per-step study that the library does not have (harness-level): no mixing at all,
CHOCO-Gossip with top-k compression as the error-feedback comparison point, and CHOCO-Gossip with scaled-sign
compression (one or two magnitudes per chunk) on a time-varying schedule (a candidate for compressed gradient
trackers). Used by :mod:`experiments.learning_per_step`."""

from __future__ import annotations

import math
from typing import Any

import torch

from gossip.algorithms.base import Algorithm


class NoMixing(Algorithm):
    """No communication: every rank keeps its own replica (the drift that mixing has to remove)."""

    name = "none"

    def _start_step(self, step: int) -> None:
        return None

    def _finish_step(self, pending: None) -> None:
        return None


class ChocoTopK(Algorithm):
    r"""CHOCO-Gossip with top-k compression on a static symmetric schedule (Koloskova et al., ICML 2019, Alg. 1).

    Each rank keeps public copies :math:`\hat x_j` of itself and of its neighbours (identical on every rank that
    holds them). Per step: :math:`q_i = \mathrm{top}_k(x_i - \hat x_i)` is sent to the neighbours (values float32 +
    indices int32); every holder adds :math:`q_j` to :math:`\hat x_j`; then
    :math:`x_i \leftarrow x_i + \gamma \sum_j W_{ij} (\hat x_j - \hat x_i)`. What top-k leaves out stays in
    :math:`x_i - \hat x_i` and is sent later (error feedback). With symmetric W the sum over ranks is preserved.
    """

    name = "choco"
    needs_symmetric_schedule = True

    def __init__(self, fraction: float, gamma: float):
        if not 0 < fraction <= 1:
            raise ValueError(f"ChocoTopK: fraction must be in (0, 1], got {fraction}")
        if not gamma > 0:
            raise ValueError(f"ChocoTopK: gamma must be positive, got {gamma}")
        self.fraction, self.gamma = fraction, gamma

    def setup(self, comm, schedule, buckets) -> None:
        super().setup(comm, schedule, buckets)
        view = schedule.peers(comm.rank, 0)
        for t in range(1, schedule.period or 1):
            if schedule.peers(comm.rank, t).in_peers != view.in_peers:
                raise ValueError(f"ChocoTopK needs a static schedule; rank {comm.rank}'s peers change at step {t}")
        self.neighbours = view.in_peers
        # x_hat = 0 on every holder (Alg. 1's initialisation): identical everywhere whatever the replicas hold
        self.public = {p: [torch.zeros_like(b.buffer) for b in buckets] for p, _ in (*view.in_peers, (comm.rank, 1))}

    def _start_step(self, step: int) -> tuple[list, list]:
        own, sends, recvs, received = self.public[self.comm.rank], [], [], []
        mine = []
        for bucket, public in zip(self.buckets, own, strict=True):
            residual = bucket.buffer - public
            k = max(1, math.ceil(self.fraction * residual.numel()))
            indices = residual.abs().topk(k, sorted=False).indices
            mine.append((indices.to(torch.int32), residual[indices].clone()))
        for peer, _ in self.neighbours:
            incoming = []
            for indices, values in mine:
                sends += [(peer, indices), (peer, values)]
                pair = (torch.empty_like(indices), torch.empty_like(values))
                recvs += [(peer, pair[0]), (peer, pair[1])]
                incoming.append(pair)
            received.append(incoming)
        return mine, [self._exchange(sends, recvs, step), received]

    def _finish_step(self, pending: tuple[list, list]) -> None:
        mine, (handle, received) = pending
        self._wait(handle)
        updates = [(self.comm.rank, mine)] + [(p, r) for (p, _), r in zip(self.neighbours, received, strict=True)]
        for peer, pairs in updates:
            for public, (indices, values) in zip(self.public[peer], pairs, strict=True):
                public.index_add_(0, indices.long(), values)
        own = self.public[self.comm.rank]
        for index, bucket in enumerate(self.buckets):
            correction = torch.zeros_like(bucket.buffer)
            for peer, weight in self.neighbours:
                correction.add_(self.public[peer][index] - own[index], alpha=weight)
            bucket.buffer.add_(correction, alpha=self.gamma)


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A 1-D bool tensor packed 8 to a byte (the first flag in the lowest bit), zero-padded to a whole byte."""
    padded = torch.zeros(math.ceil(flags.numel() / 8) * 8, dtype=torch.uint8)
    padded[: flags.numel()] = flags
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` flags :func:`pack_bits` packed, as a bool tensor."""
    return ((bits.unsqueeze(1) & _BIT_WEIGHTS) > 0).view(-1)[:numel]


def _chunked_magnitudes(residual: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``|residual|`` zero-padded to whole chunks, viewed ``(chunks, chunk)``, and a mask of the real entries."""
    numel = residual.numel()
    padded = torch.zeros(math.ceil(numel / chunk) * chunk, dtype=residual.dtype)
    padded[:numel] = residual.abs()
    real = torch.arange(padded.numel()) < numel
    return padded.view(-1, chunk), real.view(-1, chunk)


def _chunk_means(magnitudes: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Per chunk, the mean of the ``magnitudes`` its ``members`` mask selects (0 where it selects none), float32."""
    counts = members.sum(dim=1).clamp(min=1)
    return ((magnitudes * members).sum(dim=1) / counts).float()


LEVELS = (1, 2, 4)  # magnitudes per chunk pack_signs can send: one more bit a value for each doubling


def _check_levels(where: str, levels: int) -> None:
    if levels not in LEVELS:
        raise ValueError(f"{where}: levels must be 1, 2 or 4, got {levels}")


def pack_signs(residual: torch.Tensor, chunk: int, levels: int = 1) -> tuple[torch.Tensor, ...]:
    r"""Scaled-sign compression of a flat tensor: its signs packed 8 to a byte and ``levels`` scales per chunk.

    With one level the scale of a chunk is the mean absolute value of its entries, so that :func:`unpack_signs`
    returns :math:`C(r) = \frac{\lVert r_c \rVert_1}{|c|} \operatorname{sign}(r_c)` chunk by chunk (Karimireddy
    et al. 2019, "Error Feedback Fixes SignSGD", Section 3; a zero counts as +). More levels split the magnitudes of
    a chunk in halves, each at its own mean: with two, one more bit per value says whether :math:`|r_k|` reaches the
    chunk's mean; with four, a second bit says whether it reaches the mean of its half. Every group gets the mean
    magnitude of its members. Conditional means minimise the squared error for a given split, and each code is the
    next one's with two equal scales per split group, so
    :math:`\lVert C_4(r) - r \rVert \le \lVert C_2(r) - r \rVert \le \lVert C_1(r) - r \rVert` on every chunk.

    Args:
        residual: the 1-D tensor to compress.
        chunk: values per scale (a multiple of 8).
        levels: magnitudes per chunk, 1, 2 or 4.

    Returns:
        ``(signs, scales, *splits)``: uint8 bits, ``ceil(numel / 8)`` bytes each, float32 scales of shape
        ``(chunks, levels)``, and ``log2(levels)`` split bitplanes, the first split first (the entry's group is the
        planes read as a binary number, most significant first).
    """
    _check_levels("pack_signs", levels)
    magnitudes, real = _chunked_magnitudes(residual, chunk)
    signs = pack_bits(residual >= 0)
    group = torch.zeros_like(magnitudes, dtype=torch.long)
    splits = []
    groups = 1
    while groups < levels:  # split every group at its own mean magnitude
        means = torch.stack([_chunk_means(magnitudes, real & (group == g)) for g in range(groups)], dim=1)
        above = (magnitudes >= means.gather(1, group).to(magnitudes.dtype)) & real
        splits.append(pack_bits(above.view(-1)[: residual.numel()]))
        group, groups = 2 * group + above, 2 * groups
    scales = torch.stack([_chunk_means(magnitudes, real & (group == g)) for g in range(levels)], dim=1)
    return signs, scales, *splits


def unpack_signs(message: tuple[torch.Tensor, ...], numel: int, chunk: int) -> torch.Tensor:
    """The values a :func:`pack_signs` message encodes: ``scale * (+1 or -1)``, ``numel`` of them, float32.

    Args:
        message: what :func:`pack_signs` returned.
        numel: how many values were packed.
        chunk: values per scale.

    Returns:
        A new 1-D float32 tensor of ``numel`` values, identical on every rank given the same message.
    """
    signs, scales, *splits = message
    values = unpack_bits(signs, numel).float().mul_(2).sub_(1)
    group = torch.zeros(numel, dtype=torch.long)
    for plane in splits:
        group = 2 * group + unpack_bits(plane, numel).long()
    per_value = scales.repeat_interleave(chunk, dim=0)[:numel]
    return values.mul_(per_value.gather(1, group.unsqueeze(1)).squeeze(1))


class ChocoSign(Algorithm):
    r"""CHOCO-Gossip with scaled-sign compression and public copies kept per edge (Koloskova et al., ICML 2019,
    Alg. 1, on a time-varying symmetric schedule).

    For each neighbour j it has met, rank i keeps two public copies of one flat buffer per bucket:
    :math:`\hat x_{i|j}`, its own replica as j knows it, and :math:`\hat x_{j|i}`, j's as i knows it (both start
    at 0). At a step where W_ij(t) > 0, i sends :math:`q = C(x_i - \hat x_{i|j})` with :func:`pack_signs`'s
    scaled sign (one, two or four magnitudes per chunk), both ends add q to their copy of :math:`\hat x_{i|j}` (and j's
    q to :math:`\hat x_{j|i}`), so the two copies of an edge's public replicas stay bit-identical, and then

    .. math::  x_i \leftarrow x_i + \gamma \sum_j W_{ij}(t) (\hat x_{j|i} - \hat x_{i|j}).

    The edge's two corrections are equal and opposite on a symmetric W, so the sum over ranks is preserved (what
    gradient tracking needs). What the sign leaves out of a residual stays in it for the edge's next meeting (error
    feedback); for a residual of independent Gaussian entries one message removes 2/π of its energy, whatever its
    rank, where a rank-r projection removes about r/d.

    Args:
        gamma: the consensus step size γ.
        chunk: values per scale (a multiple of 8).
        levels: magnitudes per chunk (1: one bit a value; 2: two bits and two scales; 4: three bits and four).
    """

    name = "choco-sign"
    needs_symmetric_schedule = True

    def __init__(self, gamma: float = 1.0, chunk: int = 128, levels: int = 1):
        if not gamma > 0:
            raise ValueError(f"ChocoSign: gamma must be positive, got {gamma}")
        if chunk < 8 or chunk % 8:
            raise ValueError(f"ChocoSign: chunk must be a positive multiple of 8, got {chunk}")
        _check_levels("ChocoSign", levels)
        self.gamma, self.chunk, self.levels = gamma, chunk, levels
        self.public: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def _copies(self, peer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(this rank's replica as ``peer`` knows it, ``peer``'s replica as this rank knows it), per bucket."""
        if peer not in self.public:
            zeros = [torch.zeros_like(b.buffer) for b in self.buckets]
            self.public[peer] = (zeros, [torch.zeros_like(b.buffer) for b in self.buckets])
        return self.public[peer]

    def _start_step(self, step: int) -> tuple[list, list]:
        view = self.schedule.peers(self.comm.rank, step)
        sends, recvs, edges = [], [], []
        for peer, weight in view.in_peers:
            mine, _ = self._copies(peer)
            outgoing = [
                pack_signs(b.buffer - m, self.chunk, self.levels) for b, m in zip(self.buckets, mine, strict=True)
            ]
            incoming = [tuple(torch.empty_like(part) for part in message) for message in outgoing]
            for message, reply in zip(outgoing, incoming, strict=True):
                sends += [(peer, part) for part in message]
                recvs += [(peer, part) for part in reply]
            edges.append((peer, weight, outgoing, incoming))
        return edges, self._exchange(sends, recvs, step)

    def _finish_step(self, pending: tuple[list, Any]) -> None:
        edges, handle = pending
        self._wait(handle)
        for peer, weight, outgoing, incoming in edges:
            mine, theirs = self._copies(peer)
            for index, bucket in enumerate(self.buckets):
                numel = bucket.buffer.numel()
                mine[index].add_(unpack_signs(outgoing[index], numel, self.chunk))
                theirs[index].add_(unpack_signs(incoming[index], numel, self.chunk))
                bucket.buffer.add_(theirs[index] - mine[index], alpha=self.gamma * weight)
