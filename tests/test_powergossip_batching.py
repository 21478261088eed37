"""PowerGossip batches equal-shape matrices: one bmm per group, one batched Gram-Schmidt, packed exact tensors."""

from __future__ import annotations

import pytest
import torch

import gossip
import topologies
from gossip.algorithms import powergossip
from gossip.algorithms.powergossip import PowerGossip, _Matrix, group_matrices, orthonormalize
from gossip.buckets import Entry, bucket_parameters
from gossip.gpt import GPT, GPTConfig

CONFIG = GPTConfig(block_size=8, n_layer=3, n_head=2, n_embd=16)


def gpt_buckets(rank: int) -> list:
    """A small GPT's parameters, different on every rank (drawn from a per-rank generator: the simulator's ranks
    are threads, which share torch's global generator)."""
    model, generator = GPT(CONFIG), torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return bucket_parameters(model)


def bound(comm: gossip.Communicator, **options) -> PowerGossip:
    algorithm = PowerGossip(**{"rank": 2, "min_compression": 1, **options})
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), gpt_buckets(comm.rank))
    return algorithm


def groups_of_a_gpt(comm: gossip.Communicator) -> list:
    algorithm = bound(comm)
    members = [[algorithm.matrices[i].entry.name for i in g.members] for g in algorithm.groups]
    stacks_are_views = [
        torch.equal(stack, torch.stack([algorithm._matrix(algorithm.matrices[i]) for i in g.members]))
        and stack.untyped_storage().data_ptr() == algorithm.buckets[g.bucket].buffer.untyped_storage().data_ptr()
        for g, stack in zip(algorithm.groups, algorithm._stacks, strict=True)
    ]
    return [members, stacks_are_views]


def test_the_layers_of_a_gpt_form_one_zero_copy_group_per_role():
    members, stacks_are_views = gossip.simulate(2, groups_of_a_gpt)[0]
    blocks = [[f"blocks.{layer}.{role}.weight" for layer in range(3)] for role in ("attn.qkv", "attn.proj", "mlp.fc")]
    assert [["tok_emb.weight"], ["pos_emb.weight"], *blocks, [f"blocks.{i}.mlp.proj.weight" for i in range(3)]] == (
        members
    )
    assert all(stacks_are_views)


def test_a_group_ends_where_the_spacing_between_equal_matrices_breaks():
    shape = torch.Size((4, 3))
    matrices = [_Matrix(0, Entry(f"layer.{i}.w", offset, shape), 4, 3) for i, offset in enumerate((0, 20, 40, 70))]
    matrices.append(_Matrix(1, Entry("layer.4.w", 90, shape), 4, 3))  # another bucket: never batched with bucket 0
    groups = group_matrices(matrices)
    assert [(g.bucket, g.offset, g.stride, g.members) for g in groups] == [
        (0, 0, 20, (0, 1, 2)),
        (0, 70, 12, (3,)),
        (1, 90, 12, (4,)),
    ]


def steps_and_factors(comm: gossip.Communicator, steps: int, options: dict) -> dict:
    algorithm = bound(comm, **options)
    for step in range(steps):
        algorithm.step(step)
    total = torch.cat([b.buffer.double() for b in algorithm.buckets])
    comm.all_reduce(total)
    return {
        "buffers": [b.buffer.clone() for b in algorithm.buckets],
        "factors": {key: [t.clone() for t in e.p + e.q] for key, e in algorithm.edges.items()},
        "sum": total,
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_groups_keep_both_ends_bit_identical_and_the_sum(dtype):
    initial = sum(torch.cat([b.buffer.double() for b in gpt_buckets(rank)]) for rank in range(4))
    results = gossip.simulate(4, steps_and_factors, 5, {"orthonormalize_dtype": dtype})
    for rank, result in enumerate(results):
        for (lo, hi), factors in result["factors"].items():
            theirs = results[hi if rank == lo else lo]["factors"][(lo, hi)]
            assert all(torch.equal(a, b) for a, b in zip(factors, theirs, strict=True)), (rank, lo, hi)
    torch.testing.assert_close(results[0]["sum"], initial, rtol=0, atol=1e-5)


def test_batching_computes_what_the_matrix_by_matrix_path_computes(monkeypatch):
    batched = gossip.simulate(4, steps_and_factors, 5, {})
    monkeypatch.setattr(
        powergossip,
        "group_matrices",
        lambda matrices: [
            powergossip._Group(m.bucket, m.entry.offset, m.m * m.k, m.m, m.k, (i,)) for i, m in enumerate(matrices)
        ],
    )
    one_by_one = gossip.simulate(4, steps_and_factors, 5, {})
    for a, b in zip(batched, one_by_one, strict=True):
        for x, y in zip(a["buffers"], b["buffers"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_batched_orthonormalize_equals_the_per_matrix_one_and_is_orthonormal():
    batch = torch.randn(5, 30, 4, generator=torch.Generator().manual_seed(0))
    together = orthonormalize(batch)
    for i in range(5):
        torch.testing.assert_close(together[i], orthonormalize(batch[i]), rtol=0, atol=1e-6)
        torch.testing.assert_close(together[i].T @ together[i], torch.eye(4), rtol=0, atol=1e-5)
    assert torch.equal(batch, torch.randn(5, 30, 4, generator=torch.Generator().manual_seed(0)))  # input untouched


def test_an_orthonormalize_dtype_other_than_float32_or_float64_is_refused():
    with pytest.raises(ValueError, match=r"orthonormalize_dtype must be torch.float32 or torch.float64, got torch.f"):
        PowerGossip(orthonormalize_dtype=torch.float16)


def count_messages(comm: gossip.Communicator) -> list[int]:
    algorithm = bound(comm)
    counts: list[int] = []
    exchange = comm.exchange

    def counting(sends, recvs, *, seq):
        counts.append(len(sends))
        return exchange(sends, recvs, seq=seq)

    comm.exchange = counting
    algorithm.step(0)
    return [counts[0], len({index for index, _ in algorithm.exact}), len(algorithm.exact)]


def test_uncompressed_tensors_travel_as_one_message_per_bucket():
    messages, buckets_with_exact, exact_tensors = gossip.simulate(2, count_messages)[0]
    assert exact_tensors > 10  # biases and norms of three layers
    assert messages == 1 + buckets_with_exact


def resume(comm: gossip.Communicator) -> list:
    first = bound(comm)
    for step in range(3):
        first.step(step)
    state = first.state_dict()
    buffers = [b.buffer.clone() for b in first.buckets]
    for step in range(3, 6):
        first.step(step)
    second = PowerGossip(rank=2, min_compression=1)
    buckets = gpt_buckets(comm.rank)
    for bucket, saved in zip(buckets, buffers, strict=True):
        bucket.buffer.copy_(saved)
    second.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    second.load_state_dict(state)
    for step in range(3, 6):
        second.step(step)
    return [all(torch.equal(a.buffer, b.buffer) for a, b in zip(first.buckets, buckets, strict=True))]


def test_grouped_state_dict_resumes_bit_identically():
    assert all(result[0] for result in gossip.simulate(4, resume))
