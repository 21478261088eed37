r"""Scaled-sign codes: a flat tensor as its signs, 8 to a byte, and one, two or four magnitudes per chunk.

One level (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", Section 3): each chunk c of ``chunk`` values
travels as its signs and one scale, the mean absolute value of its entries,

.. math::  C_1(r)_c = \frac{\lVert r_c \rVert_1}{|c|} \operatorname{sign}(r_c)  \quad (\text{a zero counts as } +).

More levels split the magnitudes of a chunk into halves, each at its own mean: with two, one more bit per value says
whether :math:`|r_k|` reaches the chunk's mean; with four, a second bit says whether it reaches the mean of its
half. Every group gets the mean magnitude of its members. Conditional means minimise the squared error for a given
split, and each code is the next one's with the two scales of every split group equal, so on every chunk

.. math::  \lVert C_4(r) - r \rVert \le \lVert C_2(r) - r \rVert \le \lVert C_1(r) - r \rVert.

A message of ``numel`` values costs :math:`(1 + \log_2 L)` bits a value and L float32 scales per chunk. Decoding is
deterministic: every rank that holds the same message decodes the same values, bit for bit, and
:func:`encode_signs` returns the sender's decoding with its message (what :class:`gossip.ChocoSign` relies on to
keep both ends of an edge identical). On the CPU the bits are packed by numpy (``packbits``, little-endian bit
order: the same bytes as the torch path used on other devices).

How it is computed: a group's sum is the sum of the magnitudes multiplied by its members' 0/1 flags, which is exact,
and its count a float sum of 0/1; a :class:`SignCodec` keeps these work buffers for one tensor size and reuses them
call after call, so that a step allocates only the tensors it returns, while
:func:`encode_signs` and :func:`unpack_signs` make a codec of their own per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gossip.errors import InvalidArgumentError

__all__ = [
    "LEVELS",
    "SignCodec",
    "check_levels",
    "encode_signs",
    "pack_bits",
    "pack_bits_torch",
    "pack_signs",
    "unpack_bits",
    "unpack_bits_torch",
    "unpack_signs",
]

#: The magnitudes per chunk :func:`pack_signs` can send: one more bit a value for each doubling.
LEVELS = (1, 2, 4)

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def check_levels(owner: str, levels: int) -> int:
    """``levels`` if it is one of :data:`LEVELS`.

    Args:
        owner: who asks, for the message.
        levels: magnitudes per chunk.

    Returns:
        ``levels``.

    Raises:
        InvalidArgumentError: it is not (the message names ``owner``).
    """
    if levels not in LEVELS:
        raise InvalidArgumentError(f"{owner}: levels must be 1, 2 or 4, got {levels}")
    return levels


def _weights(device: torch.device) -> torch.Tensor:
    return torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A 1-D bool tensor packed 8 to a byte (the first flag in the lowest bit), zero-padded to a whole byte.

    On the CPU numpy packs them (``packbits``); elsewhere :func:`pack_bits_torch`, which gives the same bytes.

    Args:
        flags: the 1-D bool tensor.

    Returns:
        ``ceil(numel / 8)`` uint8 bytes on the flags' device.
    """
    if flags.device.type == "cpu":
        return torch.from_numpy(np.packbits(flags.contiguous().numpy(), bitorder="little"))
    return pack_bits_torch(flags)


def pack_bits_torch(flags: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bits` in torch operations, for any device (what a GPU runs).

    Args:
        flags: the 1-D bool tensor.

    Returns:
        ``ceil(numel / 8)`` uint8 bytes on the flags' device, those of :func:`pack_bits`.
    """
    padded = torch.zeros(math.ceil(flags.numel() / 8) * 8, dtype=torch.uint8, device=flags.device)
    padded[: flags.numel()] = flags
    return (padded.view(-1, 8) * _weights(flags.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` flags :func:`pack_bits` packed.

    On the CPU numpy unpacks them; elsewhere :func:`unpack_bits_torch`, which gives the same flags.

    Args:
        bits: what :func:`pack_bits` returned.
        numel: how many flags were packed.

    Returns:
        A 1-D bool tensor of ``numel`` flags.
    """
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=numel, bitorder="little").view(np.bool_))
    return unpack_bits_torch(bits, numel)


def unpack_bits_torch(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`unpack_bits` in torch operations, for any device (what a GPU runs).

    Args:
        bits: what :func:`pack_bits` returned.
        numel: how many flags were packed.

    Returns:
        A 1-D bool tensor of ``numel`` flags on the bits' device.
    """
    return ((bits.unsqueeze(1) & _weights(bits.device)) > 0).view(-1)[:numel]


@dataclass
class _Work:
    """A codec's work buffers for one size, dtype and device (every tensor but ``members`` is scratch)."""

    numel: int
    tail: int  # the last chunk's real entries
    magnitudes: torch.Tensor  # (chunks, chunk) |residual|, zero beyond numel
    product: torch.Tensor  # (chunks, chunk) a group's magnitudes, zero outside it
    members: torch.Tensor  # (chunks,) real entries per chunk, in the residual's dtype
    positive: torch.Tensor  # (numel,) bool
    upper: torch.Tensor  # (chunks, chunk) bool: the first split's upper half
    lower: torch.Tensor  # its lower half
    second: torch.Tensor  # the second split's upper halves
    mask: torch.Tensor  # one group's members
    groups: torch.Tensor  # (chunks, chunk) uint8 group ids
    index: torch.Tensor  # the same, int64, for gather
    sign: torch.Tensor  # (numel,) int8, +1 or -1
    decoded: torch.Tensor  # (chunks, chunk) float32, what decode returns

    @classmethod
    def make(cls, numel: int, chunk: int, dtype: torch.dtype, device: torch.device) -> _Work:
        chunks = max(1, math.ceil(numel / chunk))
        tail = numel - (chunks - 1) * chunk
        members = torch.full((chunks,), float(chunk), dtype=dtype, device=device)
        members[-1] = tail

        def grid(kind: torch.dtype) -> torch.Tensor:
            return torch.zeros(chunks, chunk, dtype=kind, device=device)

        flags = [grid(torch.bool) for _ in range(4)]
        return cls(
            numel, tail, grid(dtype), grid(dtype), members, torch.empty(numel, dtype=torch.bool, device=device),
            *flags, grid(torch.uint8), grid(torch.long), torch.empty(numel, dtype=torch.int8, device=device),
            grid(torch.float32),
        )  # fmt: skip


def _means(sums: list[torch.Tensor], counts: list[torch.Tensor]) -> torch.Tensor:
    """``(chunks, groups)`` float32: each group's sum over its members per chunk (0 where it has none)."""
    return torch.stack([(total / n.clamp(min=1)).float() for total, n in zip(sums, counts, strict=True)], dim=1)


def _count(flags: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Per chunk, how many ``flags`` are set, in ``scratch``'s dtype (a float sum of 0/1 up to a chunk's size is
    exact; ``scratch`` is overwritten)."""
    return scratch.copy_(flags.view(torch.uint8)).sum(dim=1)


class SignCodec:
    """The scaled-sign code (module docstring) of flat tensors of one size, with work buffers reused across calls.

    Make one per tensor that is coded every step (:class:`gossip.ChocoSign` keeps one per bucket): the buffers are
    made at the first call and again when the size, dtype or device changes, so a step allocates only what it
    returns. Not safe to share between threads.

    Args:
        chunk: values per scale (a multiple of 8).
        levels: magnitudes per chunk, 1, 2 or 4.

    Raises:
        InvalidArgumentError: ``levels`` is not 1, 2 or 4.
    """

    def __init__(self, chunk: int, levels: int = 1):
        self.chunk, self.levels = chunk, check_levels("pack_signs", levels)
        self._work: _Work | None = None

    def _buffers(self, numel: int, dtype: torch.dtype, device: torch.device) -> _Work:
        work = self._work
        if work is None or (work.numel, work.magnitudes.dtype, work.magnitudes.device) != (numel, dtype, device):
            work = self._work = _Work.make(numel, self.chunk, dtype, device)
        return work

    def _masked_sum(self, work: _Work, members: torch.Tensor) -> torch.Tensor:
        """Per chunk, the sum of the magnitudes of ``members``: multiplying by 0/1 is exact, so it is the sum of
        the magnitudes with every other entry set to 0."""
        return torch.mul(work.magnitudes, members.view(torch.uint8), out=work.product).sum(dim=1)

    def encode(self, residual: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The code of a flat tensor and the values it decodes to.

        Args:
            residual: the 1-D tensor to compress.

        Returns:
            ``(message, values)``, new tensors: the message of :func:`pack_signs` and what :meth:`decode` returns
                for it, bit for bit (float32), computed without decoding the message.
        """
        numel = residual.numel()
        work = self._buffers(numel, residual.dtype, residual.device)
        magnitudes, tail = work.magnitudes, work.tail
        torch.abs(residual, out=magnitudes.view(-1)[:numel])
        positive = torch.ge(residual, 0, out=work.positive)
        message = [pack_bits(positive)]
        sums, counts = [magnitudes.sum(dim=1)], [work.members]  # one group: every entry (the padding is 0)
        if self.levels >= 2:  # the chunk's magnitudes split at their mean
            upper = torch.ge(magnitudes, _means(sums, counts).to(magnitudes.dtype), out=work.upper)
            upper[-1, tail:] = False
            lower = torch.logical_not(upper, out=work.lower)
            lower[-1, tail:] = False
            high = _count(upper, work.product)
            sums = [self._masked_sum(work, lower), self._masked_sum(work, upper)]
            counts = [counts[0] - high, high]
            message.append(pack_bits(upper.view(-1)[:numel]))
        if self.levels == 4:  # each half split at its own mean
            means = _means(sums, counts).to(magnitudes.dtype)
            second = torch.ge(magnitudes, means[:, 1:], out=work.second).logical_and_(upper)
            second.logical_or_(torch.ge(magnitudes, means[:, :1], out=work.mask).logical_and_(lower))
            message.append(pack_bits(second.view(-1)[:numel]))
            seconds = _count(second, work.product)
            high = _count(torch.logical_and(upper, second, out=work.mask), work.product)
            sums = []
            for half in (lower, upper):  # group 2h (below the half's mean), then 2h + 1
                sums.append(self._masked_sum(work, torch.logical_not(second, out=work.mask).logical_and_(half)))
                sums.append(self._masked_sum(work, torch.logical_and(second, half, out=work.mask)))
            counts = [counts[0] - (seconds - high), seconds - high, counts[1] - high, high]
        scales = _means(sums, counts)
        if self.levels == 1:
            values = scales.expand(-1, self.chunk).contiguous()
        else:
            groups = work.upper.view(torch.uint8) if self.levels == 2 else work.groups
            if self.levels == 4:
                torch.mul(work.upper.view(torch.uint8), 2, out=groups).add_(work.second.view(torch.uint8))
            values = scales.gather(1, work.index.copy_(groups))
        values = values.view(-1)[:numel]
        sign = torch.mul(positive.view(torch.int8), 2, out=work.sign).sub_(1)
        message.insert(1, scales)
        return tuple(message), values.mul_(sign)

    def decode(self, message: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor:
        """The values a message encodes: ``scale * (+1 or -1)``, ``numel`` of them, float32.

        Args:
            message: what :meth:`encode` (or :func:`pack_signs`) returned for ``numel`` values.
            numel: how many values were coded.

        Returns:
            A 1-D float32 tensor on the message's device, identical on every rank given the same message; a
                buffer of this codec, overwritten by its next :meth:`decode`.
        """
        signs, scales, *splits = message
        work = self._buffers(numel, scales.dtype, scales.device)
        if not splits:
            decoded = work.decoded.copy_(scales.expand(-1, self.chunk))
        else:  # group g splits into 2g (bit clear) and 2g + 1 (bit set)
            groups = work.groups.view(-1)
            groups[:numel].copy_(unpack_bits(splits[0], numel).view(torch.uint8))
            for plane in splits[1:]:
                groups[:numel].mul_(2).add_(unpack_bits(plane, numel).view(torch.uint8))
            decoded = torch.gather(scales, 1, work.index.copy_(work.groups), out=work.decoded)
        sign = torch.mul(unpack_bits(signs, numel).view(torch.int8), 2, out=work.sign).sub_(1)
        return decoded.view(-1)[:numel].mul_(sign)


def encode_signs(residual: torch.Tensor, chunk: int, levels: int = 1) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The scaled-sign code of a flat tensor (module docstring) and the values it decodes to.

    :meth:`SignCodec.encode` with a codec of its own (ChocoSign keeps one per bucket instead).

    Args:
        residual: the 1-D tensor to compress.
        chunk: values per scale (a multiple of 8).
        levels: magnitudes per chunk, 1, 2 or 4.

    Returns:
        ``(message, values)``: the message of :func:`pack_signs` and what :func:`unpack_signs` returns for it,
            bit for bit (float32), computed without unpacking the message.

    Raises:
        InvalidArgumentError: ``levels`` is not 1, 2 or 4.
    """
    return SignCodec(chunk, levels).encode(residual)


def pack_signs(residual: torch.Tensor, chunk: int, levels: int = 1) -> tuple[torch.Tensor, ...]:
    """The scaled-sign code of a flat tensor (module docstring).

    Args:
        residual: the 1-D tensor to compress.
        chunk: values per scale (a multiple of 8).
        levels: magnitudes per chunk, 1, 2 or 4.

    Returns:
        ``(signs, scales, *splits)``: uint8 bits, ``ceil(numel / 8)`` bytes each, float32 scales of shape
            ``(chunks, levels)``, and ``log2(levels)`` split bitplanes, the first split first (the entry's group is
            the planes read as a binary number, most significant first).

    Raises:
        InvalidArgumentError: ``levels`` is not 1, 2 or 4.
    """
    return encode_signs(residual, chunk, levels)[0]


def unpack_signs(message: tuple[torch.Tensor, ...], numel: int, chunk: int) -> torch.Tensor:
    """The values a :func:`pack_signs` message encodes: ``scale * (+1 or -1)``, ``numel`` of them, float32.

    Args:
        message: what :func:`pack_signs` returned.
        numel: how many values were packed.
        chunk: values per scale.

    Returns:
        A new 1-D float32 tensor of ``numel`` values on the message's device, identical on every rank given the
            same message.
    """
    return SignCodec(chunk, 2 ** (len(message) - 2)).decode(message, numel)
