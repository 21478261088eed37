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
deterministic: every rank that holds the same message decodes the same values, bit for bit (what
:class:`gossip.ChocoSign` relies on to keep both ends of an edge identical).
"""

from __future__ import annotations

import math

import torch

from gossip.errors import InvalidArgumentError

__all__ = ["LEVELS", "check_levels", "pack_bits", "pack_signs", "unpack_bits", "unpack_signs"]

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
    counts = members.sum(dim=1).clamp(min=1)
    return ((magnitudes * members).sum(dim=1) / counts).float()


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
    check_levels("pack_signs", levels)
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
        A new 1-D float32 tensor of ``numel`` values on the message's device, identical on every rank given the
            same message.
    """
    signs, scales, *splits = message
    values = unpack_bits(signs, numel).float().mul_(2).sub_(1)
    group = torch.zeros(numel, dtype=torch.long, device=signs.device)
    for plane in splits:
        group = 2 * group + unpack_bits(plane, numel).long()
    per_value = scales.repeat_interleave(chunk, dim=0)[:numel]
    return values.mul_(per_value.gather(1, group.unsqueeze(1)).squeeze(1))
