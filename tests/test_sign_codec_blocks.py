"""SignCodec codes a long tensor a block at a time: the same message and values as one pass, bounded work buffers.

Every chunk's scales and bits depend on its own values only, so coding ``block`` values at a time (whole chunks)
must give the one-pass message and values bit for bit, and decoding (or adding the decoded values) block by block
the one-pass values; the codec's work buffers then hold one block, never the whole tensor.
"""

from __future__ import annotations

import pytest
import torch

from gossip.algorithms.scaled_sign import SignCodec, unpack_signs

CHUNK = 16


def _residual(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator).pow(3)
    values[::7] = 0.0  # zeros count as positive
    return values


@pytest.mark.parametrize("levels", [1, 2, 4])
@pytest.mark.parametrize("numel", [5 * CHUNK, 5 * CHUNK + 3, 2 * CHUNK - 1, 1000])
def test_coding_in_blocks_gives_the_one_pass_message_and_values_bit_for_bit(levels, numel):
    residual = _residual(numel)
    whole, values = SignCodec(CHUNK, levels, block=1 << 20).encode(residual)
    blocked = SignCodec(CHUNK, levels, block=2 * CHUNK)
    message, blocked_values = blocked.encode(residual)
    assert len(message) == len(whole) and all(torch.equal(a, b) for a, b in zip(message, whole, strict=True))
    assert torch.equal(blocked_values, values)
    out = blocked.values_buffer(numel)
    _, into = blocked.encode(residual, out=out)
    assert torch.equal(into, values) and into.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_decoding_in_blocks_and_adding_in_blocks_give_the_one_pass_values(levels):
    numel = 7 * CHUNK + 5
    message, values = SignCodec(CHUNK, levels).encode(_residual(numel, seed=1))
    blocked = SignCodec(CHUNK, levels, block=3 * CHUNK)
    assert torch.equal(blocked.decode(message, numel), values)
    assert torch.equal(blocked.decode(message, numel), unpack_signs(message, numel, CHUNK))
    target = _residual(numel, seed=2)
    expected = target + values
    assert blocked.decode_add_(message, numel, target) is target
    assert torch.equal(target, expected)


def test_the_work_buffers_hold_one_block_not_the_tensor():
    codec = SignCodec(CHUNK, 4, block=4 * CHUNK + 3)  # rounded down to whole chunks
    assert codec.block == 4 * CHUNK
    message, _ = codec.encode(_residual(100 * CHUNK + 9))
    codec.decode_add_(message, 100 * CHUNK + 9, torch.zeros(100 * CHUNK + 9))
    sizes = [work.magnitudes.numel() for work in codec._works.values()]
    assert sizes and max(sizes) <= codec.block, sizes


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_one_codec_for_tensors_of_many_sizes_codes_each_as_a_codec_of_its_own(levels):
    """A smaller tensor reuses the leading rows of a larger one's buffers; their padding must not leak into it."""
    shared = SignCodec(CHUNK, levels)
    for numel in (10 * CHUNK + 5, 3 * CHUNK + 3, 10 * CHUNK + 5, 4, 6 * CHUNK):
        residual = _residual(numel, seed=numel)
        message, values = shared.encode(residual)
        fresh_message, fresh_values = SignCodec(CHUNK, levels).encode(residual)
        assert all(torch.equal(a, b) for a, b in zip(message, fresh_message, strict=True)), numel
        assert torch.equal(values, fresh_values), numel
        assert torch.equal(shared.decode(message, numel), fresh_values), numel
    assert [work.numel for work in shared._works.values()] == [10 * CHUNK + 5]  # one set of buffers
