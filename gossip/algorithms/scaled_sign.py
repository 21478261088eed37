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
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gossip.errors import InvalidArgumentError

__all__ = ["LEVELS", "check_levels", "encode_signs", "pack_bits", "pack_signs", "unpack_bits", "unpack_signs"]

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

    Args:
        flags: the 1-D bool tensor.

    Returns:
        ``ceil(numel / 8)`` uint8 bytes on the flags' device.
    """
    if flags.device.type == "cpu":
        return torch.from_numpy(np.packbits(flags.contiguous().numpy(), bitorder="little"))
    padded = torch.zeros(math.ceil(flags.numel() / 8) * 8, dtype=torch.uint8, device=flags.device)
    padded[: flags.numel()] = flags
    return (padded.view(-1, 8) * _weights(flags.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` flags :func:`pack_bits` packed.

    Args:
        bits: what :func:`pack_bits` returned.
        numel: how many flags were packed.

    Returns:
        A 1-D bool tensor of ``numel`` flags.
    """
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=numel, bitorder="little").view(np.bool_))
    return ((bits.unsqueeze(1) & _weights(bits.device)) > 0).view(-1)[:numel]


def _chunked_magnitudes(residual: torch.Tensor, chunk: int) -> torch.Tensor:
    """``|residual|`` zero-padded to whole chunks, viewed ``(chunks, chunk)``."""
    numel = residual.numel()
    padded = torch.zeros(math.ceil(numel / chunk) * chunk, dtype=residual.dtype, device=residual.device)
    torch.abs(residual, out=padded[:numel])
    return padded.view(-1, chunk)


def _flags(flags: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool tensor as 0/1 of ``dtype`` (through uint8, a far faster conversion than from bool on the CPU)."""
    return flags.view(torch.uint8).to(dtype)


def _chunk_means(part: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Per chunk, the sum of ``part`` (a group's magnitudes, 0 outside it) over its ``members`` (0 where none is),
    float32."""
    return (part.sum(dim=1) / members.clamp(min=1)).float()


def _per_entry(groups: torch.Tensor | None, table: torch.Tensor, chunk: int) -> torch.Tensor:
    """A new ``(chunks, chunk)`` tensor: ``table[c, g]`` at each entry of chunk c whose group is g (``groups``, int64),
    or ``table[c, 0]`` everywhere when ``groups`` is None."""
    if groups is None:
        return table[:, :1].expand(-1, chunk).contiguous()
    return table.gather(1, groups)


def _signed(values: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """``values`` where ``positive``, ``-values`` elsewhere, in place (multiplying by +1 or -1 is exact)."""
    return values.mul_(_flags(positive, torch.int8).mul_(2).sub_(1))


def encode_signs(residual: torch.Tensor, chunk: int, levels: int = 1) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The scaled-sign code of a flat tensor (module docstring) and the values it decodes to.

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
    check_levels("pack_signs", levels)
    numel = residual.numel()
    magnitudes = _chunked_magnitudes(residual, chunk)
    tail = numel - (magnitudes.shape[0] - 1) * chunk  # the last chunk's real entries
    positive = residual >= 0
    signs = pack_bits(positive)
    members = torch.full(magnitudes.shape[:1], float(chunk), dtype=magnitudes.dtype, device=magnitudes.device)
    members[-1] = tail
    # per group, in group order: its magnitudes (0 outside it) and its members per chunk. A split sends group g to
    # 2g (below its mean) and 2g + 1; products and differences of magnitudes with 0/1 flags are exact, and so are
    # the integer counts, so each group's sum is that of its magnitudes masked by its members.
    parts, counts, groups, splits = [magnitudes], [members], None, []
    first_upper = None  # the first split's upper half, as 0/1 (the second split counts its members in each half)
    while len(parts) < levels:  # split every group at its own mean magnitude
        means = torch.stack([_chunk_means(part, n) for part, n in zip(parts, counts, strict=True)], dim=1)
        thresholds = means[:, :1] if groups is None else means.gather(1, groups.long())
        above = magnitudes >= thresholds.to(magnitudes.dtype)
        above[-1, tail:] = False
        splits.append(pack_bits(above.view(-1)[:numel]))
        upper = _flags(above, magnitudes.dtype)
        if first_upper is None:
            uppers = [upper.sum(dim=1)]
            first_upper = upper
        else:  # the second split (levels <= 4): the first split's lower and upper halves' members above
            high = (first_upper * upper).sum(dim=1)
            uppers = [upper.sum(dim=1) - high, high]
        tops = [part * upper for part in parts]
        parts = [piece for part, top in zip(parts, tops, strict=True) for piece in (part - top, top)]
        counts = [piece for n, up in zip(counts, uppers, strict=True) for piece in (n - up, up)]
        bits = above.view(torch.uint8)
        groups = bits if groups is None else groups.mul(2).add_(bits)  # uint8: levels <= 4 need 2 bits
    scales = torch.stack([_chunk_means(part, n) for part, n in zip(parts, counts, strict=True)], dim=1)
    values = _per_entry(None if groups is None else groups.long(), scales, chunk).view(-1)[:numel]
    return (signs, scales, *splits), _signed(values, positive)


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
    signs, scales, *splits = message
    groups = None
    if splits:  # group g splits into 2g (bit clear) and 2g + 1 (bit set)
        bits = torch.zeros(scales.shape[0] * chunk, dtype=torch.uint8, device=signs.device)
        for plane in splits:
            bits[:numel].mul_(2).add_(unpack_bits(plane, numel).view(torch.uint8))
        groups = bits.view(-1, chunk).long()
    values = _per_entry(groups, scales, chunk).view(-1)[:numel]
    return _signed(values, unpack_bits(signs, numel))
