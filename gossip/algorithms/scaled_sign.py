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


def _chunked_magnitudes(residual: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``|residual|`` zero-padded to whole chunks, viewed ``(chunks, chunk)``, and a mask of the real entries."""
    numel = residual.numel()
    padded = torch.zeros(math.ceil(numel / chunk) * chunk, dtype=residual.dtype, device=residual.device)
    padded[:numel] = residual.abs()
    real = torch.arange(padded.numel(), device=residual.device) < numel
    return padded.view(-1, chunk), real.view(-1, chunk)


def _chunk_means(magnitudes: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Per chunk, the mean of the ``magnitudes`` its ``members`` mask selects (0 where it selects none), float32."""
    weights = members.to(magnitudes.dtype)  # counts up to a chunk's size are exact in floating point
    return ((magnitudes * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)).float()


def _per_entry(masks: list[torch.Tensor], table: torch.Tensor) -> torch.Tensor:
    """``table[c, g]`` at each entry of chunk c whose group is g (``masks[g]`` holds it), shape ``(chunks, chunk)``."""
    values = table[:, :1].expand_as(masks[0])
    for group in range(1, len(masks)):
        values = torch.where(masks[group], table[:, group : group + 1], values)
    return values


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
    magnitudes, real = _chunked_magnitudes(residual, chunk)
    positive = residual >= 0
    signs = pack_bits(positive)
    masks, splits = [real], []  # the groups' members, in group order; a split sends group g to 2g and 2g + 1
    while len(masks) < levels:  # split every group at its own mean magnitude
        means = torch.stack([_chunk_means(magnitudes, members) for members in masks], dim=1)
        above = (magnitudes >= _per_entry(masks, means).to(magnitudes.dtype)) & real
        splits.append(pack_bits(above.view(-1)[:numel]))
        masks = [part for members in masks for part in (members & ~above, members & above)]
    scales = torch.stack([_chunk_means(magnitudes, members) for members in masks], dim=1)
    values = _per_entry(masks, scales).reshape(-1)[:numel]
    return (signs, scales, *splits), torch.where(positive, values, -values)


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
    padded = scales.shape[0] * chunk
    masks = [torch.ones(padded, dtype=torch.bool, device=signs.device)]
    for plane in splits:  # group g splits into 2g (bit clear) and 2g + 1 (bit set)
        above = torch.zeros(padded, dtype=torch.bool, device=signs.device)
        above[:numel] = unpack_bits(plane, numel)
        masks = [part for members in masks for part in (members & ~above, members & above)]
    values = _per_entry([members.view(-1, chunk) for members in masks], scales).reshape(-1)[:numel]
    return torch.where(unpack_bits(signs, numel), values, -values)
