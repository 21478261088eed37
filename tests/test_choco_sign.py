"""gossip.ChocoSign and its scaled-sign codes (gossip/algorithms/choco_sign.py, scaled_sign.py): the codes on worked
examples, each doubling of the levels never worse, the same codes through the torch bit path a GPU runs and through
a codec's reused buffers; on a time-varying schedule the sum preserved, both ends of every
edge holding bit-identical public copies, and the replicas contracting; resume bit-identical; a peer's NaN and a
wrong setting or checkpoint refused by name. Gloo and MPI against the simulator: test_gradient_tracking_powergossip.py
(the trackers' case ``sign``)."""

from __future__ import annotations

import pytest
import torch

import gossip
import topologies
from gossip.algorithms import scaled_sign
from gossip.algorithms.buckets import pack
from gossip.algorithms.scaled_sign import SignCodec, pack_signs, unpack_signs
from gossip.errors import CheckpointMismatchError, InvalidArgumentError, NonFiniteError


def _random_buckets(rank: int, shape=(24, 12)) -> list:
    generator = torch.Generator().manual_seed(1000 + rank)
    return pack([("w", torch.randn(*shape, generator=generator, dtype=torch.float64))])


def test_scaled_sign_packs_a_bit_per_value_and_a_mean_absolute_value_per_chunk():
    residual = torch.tensor([0.5, -1.5, 0.0, 2.0, -1.0, 1.0, 3.0, -3.0, 4.0, -0.5])
    bits, scales = message = pack_signs(residual, chunk=8)
    assert bits.dtype == torch.uint8 and bits.numel() == 2 and scales.tolist() == [[12 / 8], [4.5 / 2]]
    signs = torch.tensor([1, -1, 1, 1, -1, 1, 1, -1, 1, -1], dtype=torch.float32)  # a zero counts as +
    expected = signs * torch.tensor([1.5] * 8 + [2.25] * 2)
    assert torch.equal(unpack_signs(message, residual.numel(), chunk=8), expected)


def test_two_level_sign_gives_each_side_of_the_chunks_mean_magnitude_its_own_mean():
    residual = torch.tensor([0.5, -1.5, 0.0, 2.0, -1.0, 1.0, 3.0, -3.0, 4.0, -0.5])
    signs, scales, high = message = pack_signs(residual, chunk=8, levels=2)
    assert signs.numel() == high.numel() == 2 and scales.shape == (2, 2)
    # chunk 1: mean |r| 1.5; below it 0.5, 0, 1, 1 (mean 0.625), at or above 1.5, 2, 3, 3 (mean 2.375);
    # chunk 2 (two real entries, six of padding): mean 2.25; below 0.5, above 4
    assert scales.tolist() == [[0.625, 2.375], [0.5, 4.0]]
    signs_expected = torch.tensor([1, -1, 1, 1, -1, 1, 1, -1, 1, -1], dtype=torch.float32)
    magnitudes = torch.tensor([0.625, 2.375, 0.625, 2.375, 0.625, 0.625, 2.375, 2.375, 4.0, 0.5])
    assert torch.equal(unpack_signs(message, residual.numel(), chunk=8), signs_expected * magnitudes)


def test_each_doubling_of_the_levels_is_never_worse_and_exact_on_that_many_magnitudes():
    generator = torch.Generator().manual_seed(0)
    for residual in (torch.randn(1000, generator=generator), torch.randn(1000, generator=generator).pow(3)):
        codes = [unpack_signs(pack_signs(residual, chunk=64, levels=k), 1000, chunk=64) for k in (1, 2, 4)]
        for start in range(0, 1000, 64):  # chunk by chunk
            window = slice(start, start + 64)
            one, two, four = ((code[window] - residual[window]).square().sum() for code in codes)
            assert four <= two * (1 + 1e-6) and two <= one * (1 + 1e-6)
        assert (codes[2] - residual).square().sum() < 0.5 * (codes[1] - residual).square().sum()
    values = torch.tensor([0.25, -4.0, -0.25, 4.0] * 4)
    assert torch.equal(unpack_signs(pack_signs(values, chunk=16, levels=2), values.numel(), chunk=16), values)
    values = torch.tensor([1.0, -20.0, -2.0, 10.0] * 6)  # split at 8.25, then at 1.5 and at 15
    message = pack_signs(values, chunk=24, levels=4)
    assert len(message) == 4 and message[1].tolist() == [[1.0, 2.0, 10.0, 20.0]]  # signs, scales, two split planes
    assert torch.equal(unpack_signs(message, values.numel(), chunk=24), values)
    with pytest.raises(InvalidArgumentError, match="pack_signs: levels must be 1, 2 or 4, got 3"):
        pack_signs(values, chunk=16, levels=3)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 1001])
def test_the_torch_bit_path_packs_and_unpacks_the_bytes_numpy_does(numel):
    """pack_bits / unpack_bits hand non-CPU tensors to their torch versions: the same bytes and flags."""
    flags = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.5
    packed = scaled_sign.pack_bits(flags)  # numpy on the CPU
    assert packed.dtype == torch.uint8 and packed.numel() == -(-numel // 8)
    assert torch.equal(scaled_sign.pack_bits_torch(flags), packed)
    assert torch.equal(scaled_sign.unpack_bits_torch(packed, numel), flags)
    assert torch.equal(scaled_sign.unpack_bits(packed, numel), flags)


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_the_code_through_the_torch_bit_path_and_through_reused_buffers_is_the_same(monkeypatch, levels):
    """What a GPU runs (the torch bit path) and what ChocoSign runs (one codec, its buffers reused, across sizes)
    give the messages and decodings of a fresh call on the CPU, bit for bit, signed zeros included."""
    generator = torch.Generator().manual_seed(levels)
    residuals = [torch.randn(n, generator=generator) for n in (1000, 1000, 37)] + [torch.zeros(40), -torch.zeros(40)]
    fresh = [scaled_sign.encode_signs(r, 16, levels) for r in residuals]
    codec = SignCodec(16, levels)
    monkeypatch.setattr(scaled_sign, "pack_bits", scaled_sign.pack_bits_torch)
    monkeypatch.setattr(scaled_sign, "unpack_bits", scaled_sign.unpack_bits_torch)
    for residual, (message, values) in zip(residuals, fresh, strict=True):
        again, decoded = codec.encode(residual)
        assert len(again) == len(message) and all(torch.equal(a, b) for a, b in zip(again, message, strict=True))
        for got in (decoded, codec.decode(again, residual.numel()), unpack_signs(again, residual.numel(), 16)):
            assert torch.equal(got, values) and torch.equal(got.signbit(), values.signbit())


def _choco_sign(comm, steps: int, levels: int = 1):
    algorithm = gossip.ChocoSign(gamma=1.0, chunk=16, levels=levels)
    buckets = _random_buckets(comm.rank)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    totals = [buckets[0].buffer.clone()]
    comm.all_reduce(totals[0], "sum")
    for step in range(steps):
        algorithm.step(step)
    totals.append(buckets[0].buffer.clone())
    comm.all_reduce(totals[1], "sum")
    spread = buckets[0].buffer.clone()
    comm.all_reduce(spread, "avg")
    copies = comm.all_gather_object({p: [t.clone() for t in pair[0] + pair[1]] for p, pair in algorithm.public.items()})
    return totals, float((buckets[0].buffer - spread).square().sum()), copies, algorithm.traffic


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_choco_sign_on_a_time_varying_schedule_preserves_the_sum_keeps_edge_copies_identical_and_contracts(levels):
    """Per-edge public copies: rank i's copy of (i as j knows it, j as i knows it) equals rank j's (j, i) pair
    swapped, bit for bit; the sum over ranks is what it was; error feedback brings the replicas together."""
    before = gossip.simulate(8, _choco_sign, 0, levels)[0][1]
    results = gossip.simulate(8, _choco_sign, 60, levels)
    (total_before, total_after), after, copies, traffic = results[0]
    torch.testing.assert_close(total_after, total_before, rtol=0, atol=1e-10)
    assert after < 1e-3 * before
    for rank, held in enumerate(copies):
        assert sorted(held) == sorted([rank ^ 1, rank ^ 2, rank ^ 4])  # the hypercube's three partners
        for peer, tensors in held.items():
            half = len(tensors) // 2
            theirs = copies[peer][rank]
            for mine, swapped in zip(tensors, theirs[half:] + theirs[:half], strict=True):
                assert torch.equal(mine, swapped), f"ranks {rank} and {peer} disagree on their edge's public copies"
    # the last step, to one peer: signs and log2(levels) split bits a value, and a float32 scale per level and chunk
    assert sum(traffic.last_sent.values()) == levels.bit_length() * 288 // 8 + levels * 4 * 288 // 16


def _resumed(comm, steps: int, stop: int | None) -> list[torch.Tensor]:
    """``steps`` steps of ChocoSign; with ``stop``, through a fresh instance loaded from the state after ``stop``."""
    buckets = _random_buckets(comm.rank)
    schedule = topologies.one_peer_hypercube(comm.size)
    algorithm = gossip.ChocoSign(chunk=16, levels=4)
    algorithm.setup(comm, schedule, buckets)
    for step in range(steps):
        if step == stop:
            state = algorithm.state_dict()
            algorithm = gossip.ChocoSign(chunk=16, levels=4)
            algorithm.setup(comm, schedule, buckets)
            algorithm.load_state_dict(state)
        algorithm.step(step)
    return [b.buffer.clone() for b in buckets]


def test_resume_from_the_state_dict_is_bit_identical():
    uninterrupted = gossip.simulate(8, _resumed, 12, None)
    resumed = gossip.simulate(8, _resumed, 12, 5)
    for rank in range(8):
        assert torch.equal(resumed[rank][0], uninterrupted[rank][0]), f"rank {rank}"


def _load_into_another_layout(comm) -> str:
    algorithm = gossip.ChocoSign(chunk=16)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), _random_buckets(comm.rank))
    algorithm.step(0)
    other = gossip.ChocoSign(chunk=16)
    other.setup(comm, topologies.one_peer_hypercube(comm.size), _random_buckets(comm.rank, shape=(12, 12)))
    try:
        other.load_state_dict(algorithm.state_dict())
    except CheckpointMismatchError as error:
        return str(error)
    return "loaded"


def test_a_state_of_another_layout_is_refused_naming_the_rank_and_the_edge():
    messages = gossip.simulate(2, _load_into_another_layout)
    assert messages[1] == (
        "rank 1: the saved ChocoSign copies of the edge to peer 0 do not have this run's bucket layout"
    )


def _nan_on_rank_2(comm) -> str:
    buckets = _random_buckets(comm.rank)
    algorithm = gossip.ChocoSign(chunk=16)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    algorithm.step(0)
    if comm.rank == 2:
        buckets[0].buffer[5] = float("nan")
    try:
        algorithm.step(1)
    except NonFiniteError as error:
        return str(error)
    return "mixed"


def test_a_peers_nan_raises_naming_the_rank_the_step_and_the_peer():
    messages = gossip.simulate(4, _nan_on_rank_2)
    # the one-peer hypercube pairs 2 with 0 at step 1 (2 xor 2): rank 0 receives the NaN scale, rank 2 rank 0's
    assert messages[0] == (
        "rank 0: step 1: peer 2 sent non-finite values (NaN or Inf) to mix in; its replica has diverged. ChocoSign has "
        "no 'drop': both ends of an edge must apply the same messages"
    )
    assert messages[1] == messages[3] == "mixed"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"gamma": 0.0}, "ChocoSign: gamma must be positive, got 0.0"),
        ({"chunk": 12}, "ChocoSign: chunk must be a positive multiple of 8, got 12"),
        ({"chunk": 8.0}, "ChocoSign: chunk must be a positive multiple of 8, got 8.0"),
        ({"levels": 3}, "ChocoSign: levels must be 1, 2 or 4, got 3"),
    ],
)
def test_settings_outside_the_contract_are_refused(arguments, message):
    with pytest.raises(InvalidArgumentError) as error:
        gossip.ChocoSign(**arguments)
    assert str(error.value) == message
