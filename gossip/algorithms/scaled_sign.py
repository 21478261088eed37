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

How it is computed: the flags are 0/1 in the residual's dtype, a group's magnitudes are the magnitudes times its
members' flags (or a difference of two such products, |r| - |r| or |r| - 0), which is exactly the magnitudes with
every other entry set to 0, and its count is a float sum of 0/1, also exact. The values come out of one gather
from a table of the chunk's signed scales, :math:`(-s_0, \dots, -s_{L-1}, s_0, \dots, s_{L-1})`, at the index
:math:`L \cdot [r_k \ge 0] + \text{group}_k`: for a finite scale, :math:`\pm s` is :math:`s \cdot (\pm 1)` bit
for bit (negation and a product with 1 are exact), so this is the same value as the scale times the sign, in one
pass instead of three. A :class:`SignCodec` keeps its work buffers for one tensor size and reuses them call after
call, so that a step allocates only the message it returns (and the values too unless ``out`` is given), while
:func:`encode_signs` and :func:`unpack_signs` make a codec of their own per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gossip.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_BLOCK",
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

#: The most values a :class:`SignCodec` codes at once: its work buffers are those of one block of this many values.
DEFAULT_BLOCK = 1 << 20


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
    """A codec's work buffers for one size, dtype and device (every tensor but ``members`` is scratch).

    The encoder's flags are 0/1 in the residual's dtype (``up``, ``split``): a comparison written as floats, a
    product with them and a float sum of them are exact, and on the CPU each is a vectorised pass where one with
    bool operands is not. The bool copies (``upper``, ``second``) are what is packed, and the decoder's index.
    """

    numel: int
    tail: int  # the last chunk's real entries
    magnitudes: torch.Tensor  # (chunks, chunk) |residual|, zero beyond numel
    members: torch.Tensor  # (chunks,) real entries per chunk, in the residual's dtype
    up: torch.Tensor  # (chunks, chunk) 1 on the first split's upper half, else 0
    split: torch.Tensor  # 1 where the second split's bit is set, else 0
    upper_part: torch.Tensor  # the magnitudes on the upper half (0 elsewhere), then on group 2
    lower_part: torch.Tensor  # on the lower half, then on group 0
    part: torch.Tensor  # scratch: the sign flags, a group's members, its magnitudes
    positive: torch.Tensor  # (numel,) bool
    upper: torch.Tensor  # (chunks, chunk) bool: ``up``
    second: torch.Tensor  # bool: ``split``
    groups: torch.Tensor  # (chunks, chunk) uint8 indices into the signed scales: L * (sign bit) + group
    index: torch.Tensor  # the same, int64, for gather
    signed: torch.Tensor  # (chunks, 2 L) float32: the chunk's scales negated, then as they are
    decoded: torch.Tensor  # (chunks, chunk) float32, what decode returns

    @classmethod
    def make(cls, numel: int, chunk: int, levels: int, dtype: torch.dtype, device: torch.device) -> _Work:
        chunks = max(1, math.ceil(numel / chunk))
        tail = numel - (chunks - 1) * chunk
        members = torch.full((chunks,), float(chunk), dtype=dtype, device=device)
        members[-1] = tail

        def grid(kind: torch.dtype) -> torch.Tensor:
            return torch.zeros(chunks, chunk, dtype=kind, device=device)

        return cls(
            numel, tail, grid(dtype), members, *(grid(dtype) for _ in range(5)),
            torch.empty(numel, dtype=torch.bool, device=device), grid(torch.bool), grid(torch.bool),
            grid(torch.uint8), grid(torch.long), torch.empty(chunks, 2 * levels, dtype=torch.float32, device=device),
            grid(torch.float32),
        )  # fmt: skip

    def leading(self, numel: int, chunk: int, members: torch.Tensor) -> _Work:
        """These buffers' leading rows as the work of ``numel`` <= :attr:`numel` values (``members`` its counts);
        the magnitudes' padding past ``numel`` is zeroed, as a work made for ``numel`` has it."""
        chunks = members.numel()
        rows = slice(0, chunks)
        self.magnitudes.view(-1)[numel : chunks * chunk].zero_()
        return _Work(
            numel, numel - (chunks - 1) * chunk, self.magnitudes[rows], members, self.up[rows], self.split[rows],
            self.upper_part[rows], self.lower_part[rows], self.part[rows], self.positive[:numel], self.upper[rows],
            self.second[rows], self.groups[rows], self.index[rows], self.signed[rows], self.decoded[rows],
        )  # fmt: skip

    def signed_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """The table the values are gathered from: ``(-scales, scales)`` side by side, per chunk."""
        levels = scales.shape[1]
        signed = (
            self.signed if self.signed.shape[1] == 2 * levels else self.signed.new_empty(scales.shape[0], 2 * levels)
        )
        torch.neg(scales, out=signed[:, :levels])
        signed[:, levels:].copy_(scales)
        return signed

    def gather(self, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (chunks, chunk) <- each entry's signed scale, read at :attr:`groups` (the padding's indices set
        to 0 first, so that a gather never reads outside the table)."""
        self.groups.view(-1)[self.numel :].zero_()
        return torch.gather(self.signed_scales(scales), 1, self.index.copy_(self.groups), out=out)


def _means(sums: list[torch.Tensor], counts: list[torch.Tensor]) -> torch.Tensor:
    """``(chunks, groups)`` float32: each group's sum over its members per chunk (0 where it has none)."""
    return torch.stack([(total / n.clamp(min=1)).float() for total, n in zip(sums, counts, strict=True)], dim=1)


class SignCodec:
    """The scaled-sign code (module docstring) of flat tensors, with work buffers reused across calls.

    Make one for the tensors coded every step (:class:`gossip.ChocoSign` keeps one for all its buckets): the buffers
    are made at the first call and again when a larger size, another dtype or another device comes, and a smaller
    tensor uses their leading rows, so a step allocates only what it returns. A tensor longer than ``block`` values
    is coded ``block`` values at a time (a whole number of chunks, so whole bytes of every bit plane): every chunk's
    code depends on its own values only, so the message and the values are those of one pass, bit for bit, while
    the work buffers (a float32 and an int64 grid among them) hold one block, not the tensor. Not safe to share
    between threads.

    Args:
        chunk: values per scale (a multiple of 8).
        levels: magnitudes per chunk, 1, 2 or 4.
        block: the most values coded at once (rounded down to whole chunks, at least one).

    Raises:
        InvalidArgumentError: ``levels`` is not 1, 2 or 4.
    """

    def __init__(self, chunk: int, levels: int = 1, block: int = DEFAULT_BLOCK):
        self.chunk, self.levels = chunk, check_levels("pack_signs", levels)
        self.block = max(1, block // chunk) * chunk
        self._works: dict[tuple[torch.dtype, torch.device], _Work] = {}  # the largest size coded so far
        self._members: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # per smaller size

    def _buffers(self, numel: int, dtype: torch.dtype, device: torch.device) -> _Work:
        """Work buffers for ``numel`` values: the largest size's, whose leading rows serve any smaller size."""
        work = self._works.get((dtype, device))
        if work is None or work.numel < numel:
            work = self._works[dtype, device] = _Work.make(numel, self.chunk, self.levels, dtype, device)
        if work.numel == numel:
            return work
        members = self._members.get((numel, dtype, device))
        if members is None:
            chunks = max(1, math.ceil(numel / self.chunk))
            members = torch.full((chunks,), float(self.chunk), dtype=dtype, device=device)
            members[-1] = numel - (chunks - 1) * self.chunk
            self._members[numel, dtype, device] = members
        return work.leading(numel, self.chunk, members)

    def _blocks(self, numel: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of the blocks of a tensor of ``numel`` values (one when it fits one)."""
        return [(start, min(start + self.block, numel)) for start in range(0, max(numel, 1), self.block)]

    def _part(self, message: tuple[torch.Tensor, ...], start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """The message of values ``start:stop`` (whole chunks from ``start``) within a whole tensor's message."""
        signs, scales, *planes = message
        chunks, size = slice(start // self.chunk, -(-stop // self.chunk)), slice(start // 8, -(-stop // 8))
        return (signs[size], scales[chunks], *(plane[size] for plane in planes))

    def values_buffer(self, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """A float32 buffer :meth:`encode` can write the values of ``numel`` entries into (its ``out``).

        Args:
            numel: how many values will be coded.
            device: where (default the CPU).

        Returns:
            An uninitialised float32 tensor of ``ceil(numel / chunk) * chunk`` elements (at least one chunk).
        """
        return torch.empty(max(1, math.ceil(numel / self.chunk)) * self.chunk, dtype=torch.float32, device=device)

    def encode(
        self, residual: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The code of a flat tensor and the values it decodes to, ``block`` values at a time.

        Args:
            residual: the 1-D tensor to compress.
            out: where to write the values: a contiguous float32 tensor of :meth:`values_buffer`'s size on the
                residual's device (its first ``numel`` elements are the values); None makes a new one.

        Returns:
            ``(message, values)``: the message of :func:`pack_signs` (new tensors) and what :meth:`decode` returns
                for it, bit for bit (float32; a view of ``out`` when given), computed without decoding the message.

        Raises:
            InvalidArgumentError: ``out`` is not a contiguous float32 tensor of that size on that device.
        """
        numel = residual.numel()
        if numel <= self.block:
            return self._encode_block(residual, out)
        grid = self._values_grid(out, numel, residual.device) if out is not None else None
        values = (grid if grid is not None else self.values_buffer(numel, residual.device)).view(-1)
        parts = []
        for start, stop in self._blocks(numel):
            chunked = start + -(-(stop - start) // self.chunk) * self.chunk
            parts.append(self._encode_block(residual[start:stop], out=values[start:chunked])[0])
        message = tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))
        return message, values[:numel]

    def _encode_block(
        self, residual: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """:meth:`encode` of one block, in one pass (``out`` as for :meth:`encode`)."""
        numel = residual.numel()
        work = self._buffers(numel, residual.dtype, residual.device)
        magnitudes, tail, dtype = work.magnitudes, work.tail, residual.dtype
        torch.abs(residual, out=magnitudes.view(-1)[:numel])
        positive = work.positive.copy_(torch.ge(residual, 0, out=work.part.view(-1)[:numel]))
        message = [pack_bits(positive)]
        sums, counts = [magnitudes.sum(dim=1)], [work.members]  # one group: every entry (the padding is 0)
        if self.levels >= 2:  # the chunk's magnitudes split at their mean
            up = torch.ge(magnitudes, _means(sums, counts).to(dtype), out=work.up)
            up[-1, tail:] = 0
            high = up.sum(dim=1)
            # a group's magnitudes: |r| on its members, 0 elsewhere (each a product with 1 or 0, or a difference
            # with 0 or with itself, so exactly the magnitudes masked)
            upper_part = torch.mul(magnitudes, up, out=work.upper_part)
            lower_part = torch.sub(magnitudes, upper_part, out=work.lower_part)
            sums = [lower_part.sum(dim=1), upper_part.sum(dim=1)]
            counts = [counts[0] - high, high]
            message.append(pack_bits(work.upper.copy_(up).view(-1)[:numel]))
        if self.levels == 4:  # each half split at its own mean
            means = _means(sums, counts).to(dtype)
            split = torch.ge(magnitudes, means[:, 1:], out=work.split).mul_(up)
            below = torch.ge(magnitudes, means[:, :1], out=work.part)
            split.add_(torch.gt(below, up, out=below))  # the lower half's entries at or above its mean
            split[-1, tail:] = 0
            message.append(pack_bits(work.second.copy_(split).view(-1)[:numel]))
            seconds = split.sum(dim=1)
            top = torch.mul(up, split, out=work.part)  # group 3: the upper half at or above its mean
            high = top.sum(dim=1)
            top_sum = top.mul_(magnitudes).sum(dim=1)
            upper_part.sub_(top)  # group 2
            lower_high = torch.mul(lower_part, split, out=work.part)  # group 1
            lower_part.sub_(lower_high)  # group 0
            sums = [lower_part.sum(dim=1), lower_high.sum(dim=1), upper_part.sum(dim=1), top_sum]
            counts = [counts[0] - (seconds - high), seconds - high, counts[1] - high, high]
        scales = _means(sums, counts)
        # the index into the signed scales: levels * (sign bit) + group, the group's bits read as a binary number
        index = work.groups.view(-1)[:numel]
        bit = positive.view(torch.uint8)
        if self.levels == 1:
            index.copy_(bit)
        elif self.levels == 2:
            torch.mul(bit, 2, out=index).add_(work.upper.view(torch.uint8).view(-1)[:numel])
        else:
            torch.mul(work.upper.view(torch.uint8), 2, out=work.groups).add_(work.second.view(torch.uint8))
            index.add_(bit, alpha=4)
        grid = self._values_grid(out, numel, residual.device) if out is not None else None
        values = work.gather(scales, grid if grid is not None else torch.empty_like(work.decoded))
        message.insert(1, scales)
        return tuple(message), values.view(-1)[:numel]

    def _values_grid(self, out: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
        """``out`` as the (chunks, chunk) grid the values are gathered into, or a named error."""
        size = max(1, math.ceil(numel / self.chunk)) * self.chunk
        if out.dtype != torch.float32 or out.numel() != size or not out.is_contiguous() or out.device != device:
            raise InvalidArgumentError(
                f"SignCodec.encode: out must be a contiguous float32 tensor of {size} elements on {device} (see "
                f"values_buffer), got {out.dtype} of {out.numel()} elements on {out.device}"
            )
        return out.view(-1, self.chunk)

    def decode(self, message: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor:
        """The values a message encodes: ``scale * (+1 or -1)``, ``numel`` of them, float32.

        Args:
            message: what :meth:`encode` (or :func:`pack_signs`) returned for ``numel`` values.
            numel: how many values were coded.

        Returns:
            A 1-D float32 tensor on the message's device, identical on every rank given the same message; a
                buffer of this codec, overwritten by its next :meth:`decode` (a new tensor beyond one block).
        """
        if numel <= self.block:
            return self._decode_block(message, numel)
        values = torch.empty(numel, dtype=torch.float32, device=message[1].device)
        for start, stop in self._blocks(numel):
            values[start:stop] = self._decode_block(self._part(message, start, stop), stop - start)
        return values

    def decode_add_(self, message: tuple[torch.Tensor, ...], numel: int, target: torch.Tensor) -> torch.Tensor:
        """``target += decode(message)``, ``block`` values at a time (no buffer of the whole tensor's values).

        Args:
            message: what :meth:`encode` returned for ``numel`` values.
            numel: how many values were coded.
            target: a 1-D tensor of ``numel`` values, added to in place (in its own dtype, as ``add_`` does).

        Returns:
            ``target``.
        """
        for start, stop in self._blocks(numel):
            part = message if (start, stop) == (0, numel) else self._part(message, start, stop)
            target[start:stop].add_(self._decode_block(part, stop - start))
        return target

    def _decode_block(self, message: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor:
        """:meth:`decode` of one block, into this codec's buffer."""
        signs, scales, *splits = message
        work = self._buffers(numel, scales.dtype, scales.device)
        # the index into the signed scales: the sign bit, then each split's bit (group g splits into 2g, bit
        # clear, and 2g + 1, bit set), read as a binary number: levels * (sign bit) + group
        index = work.groups.view(-1)[:numel]
        index.copy_(unpack_bits(signs, numel).view(torch.uint8))
        for plane in splits:
            index.mul_(2).add_(unpack_bits(plane, numel).view(torch.uint8))
        return work.gather(scales, work.decoded).view(-1)[:numel]


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
