"""The scaled-sign codec's values, gathered from a table of signed scales, equal the scale of each entry's group
times its sign, bit for bit, in the encode (into a new tensor or the caller's buffer) and the decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossip.algorithms.scaled_sign import SignCodec
from gossip.errors import InvalidArgumentError


def _reference(message: tuple[torch.Tensor, ...], numel: int, chunk: int) -> torch.Tensor:
    """Each entry's group scale times +1.0 or -1.0 (a float product), read from the message with numpy."""
    signs, scales, *splits = message
    bits = [np.unpackbits(plane.numpy(), count=numel, bitorder="little").astype(np.int64) for plane in splits]
    group = np.zeros(numel, dtype=np.int64)
    for plane in bits:
        group = group * 2 + plane
    rows = np.arange(numel) // chunk
    sign = np.where(np.unpackbits(signs.numpy(), count=numel, bitorder="little") == 1, 1.0, -1.0)
    magnitude = scales[torch.from_numpy(rows), torch.from_numpy(group)]
    return magnitude * torch.from_numpy(sign).float()


def _residuals() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tiny = torch.full((48,), 1e-45) * torch.tensor([1.0, -1.0, 0.0]).repeat(16)  # denormals and zeros
    return [torch.randn(n, generator=generator) for n in (1000, 37, 256)] + [torch.zeros(40), -torch.zeros(40), tiny]


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_the_values_are_each_groups_scale_times_the_sign_bit_for_bit(levels):
    codec, decoder = SignCodec(16, levels), SignCodec(16, levels)
    for residual in _residuals():
        message, values = codec.encode(residual)
        expected = _reference(message, residual.numel(), 16)
        out = codec.values_buffer(residual.numel())
        again, into = codec.encode(residual, out=out)
        decoded = decoder.decode(message, residual.numel())
        assert all(torch.equal(a, b) for a, b in zip(again, message, strict=True))
        assert into.data_ptr() == out.data_ptr()
        for got in (values, into, decoded):
            assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


def test_an_out_buffer_of_the_wrong_size_or_dtype_is_refused_by_name():
    codec = SignCodec(16, 4)
    with pytest.raises(InvalidArgumentError, match="out must be a contiguous float32 tensor of 48 elements"):
        codec.encode(torch.randn(37), out=torch.empty(37))
    with pytest.raises(InvalidArgumentError, match=r"got torch\.float64 of 48 elements"):
        codec.encode(torch.randn(37), out=torch.empty(48, dtype=torch.float64))
