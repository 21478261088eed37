"""Hierarchical gossip on the simulator: it applies W(t) = W_node(t) kron (1/L) 1 1^T (docs/design.md E.2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gossip
import topologies
from gossip.algorithms.buckets import pack
from gossip.algorithms.hierarchical import HierarchicalGossip, assign_whole_tensors, shard_bounds

SHAPES = {"embed.weight": (12, 12), "fc.weight": (12, 12), "fc.bias": (12,), "head.weight": (12, 12), "tiny": (3,)}
LAYOUTS = [(2, 2), (4, 2), (2, 4), (8, 1), (1, 4), (2, 3)]  # (nodes, per node)
STEPS = 4


def full_rank_matrices(name: str, shape: torch.Size) -> bool | None:
    return True if len(shape) == 2 else None


def mix(comm: gossip.Communicator, compress_rank: int | None, steps: int = STEPS, **options) -> dict:
    generator = torch.Generator().manual_seed(comm.rank)
    named = [(name, torch.randn(shape, generator=generator, dtype=torch.float64)) for name, shape in SHAPES.items()]
    buckets = pack(named, bucket_bytes=1500)
    before = torch.cat([b.buffer for b in buckets]).clone()
    algorithm = HierarchicalGossip(compress_rank, **options)
    algorithm.setup(comm, None, buckets)
    for step in range(steps):
        algorithm.step(step)
    compressed = algorithm.inner.describe()["compressed"] if algorithm.inner is not None else []
    after = torch.cat([b.buffer for b in buckets])
    return {"before": before, "after": after, "traffic": algorithm.traffic, "compressed": compressed}


def run(nodes: int, per_node: int, compress_rank: int | None, **options) -> tuple[np.ndarray, np.ndarray, list]:
    results = gossip.simulate(nodes * per_node, mix, compress_rank, local_size=per_node, **options)
    before = torch.stack([r["before"] for r in results]).numpy()
    after = torch.stack([r["after"] for r in results]).numpy()
    return before, after, results


def apply_schedule(nodes: int, per_node: int, x: np.ndarray, steps: int = STEPS) -> np.ndarray:
    schedule = topologies.hierarchical(nodes, per_node)
    for t in range(steps):
        x = schedule.mixing_matrix(t) @ x
    return x


@pytest.mark.parametrize(("nodes", "per_node"), LAYOUTS)
def test_hierarchical_mixing_matrix_is_symmetric_doubly_stochastic_kronecker(nodes, per_node):
    schedule = topologies.hierarchical(nodes, per_node)
    node_level = topologies.one_peer_hypercube(nodes) if nodes > 1 else None
    for t in range(schedule.period):
        w = schedule.mixing_matrix(t)
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        np.testing.assert_array_equal(w, w.T)
        w_node = node_level.mixing_matrix(t) if node_level is not None else np.ones((1, 1))
        np.testing.assert_allclose(w, np.kron(w_node, np.full((per_node, per_node), 1.0 / per_node)), atol=1e-15)


@pytest.mark.parametrize(("nodes", "per_node"), LAYOUTS)
def test_exact_variant_applies_the_schedule_matrix(nodes, per_node):
    before, after, _ = run(nodes, per_node, None)
    np.testing.assert_allclose(after, apply_schedule(nodes, per_node, before), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (4, 2), (2, 3)])
def test_full_rank_compressed_variant_applies_the_schedule_matrix(nodes, per_node):
    before, after, results = run(nodes, per_node, 12, policy=full_rank_matrices)
    compressed = sorted(name for r in results[:per_node] for name in r["compressed"])
    assert compressed == ["embed.weight", "fc.weight", "head.weight"]  # the node's local ranks share the matrices
    np.testing.assert_allclose(after, apply_schedule(nodes, per_node, before), rtol=0, atol=1e-6)


@pytest.mark.parametrize("compress_rank", [None, 1])
def test_sum_over_ranks_is_preserved(compress_rank):
    before, after, _ = run(4, 2, compress_rank, min_compression=1)
    np.testing.assert_allclose(after.sum(axis=0), before.sum(axis=0), rtol=0, atol=1e-10)


def test_exact_variant_leaves_a_node_and_its_partner_node_bit_identical():
    _, after, _ = run(4, 2, None, steps=1)  # step 0 pairs nodes {0, 1} and {2, 3}
    assert all(np.array_equal(after[0], after[r]) for r in (1, 2, 3))
    assert all(np.array_equal(after[4], after[r]) for r in (5, 6, 7))


def test_compressed_variant_leaves_the_ranks_of_a_node_bit_identical():
    _, after, _ = run(4, 2, 1, steps=3, min_compression=1)
    assert all(np.array_equal(after[2 * node], after[2 * node + 1]) for node in range(4))
    assert not np.array_equal(after[0], after[2])  # a low-rank correction: partner nodes still differ


def test_exact_variant_reaches_the_global_average_after_log2_nodes_steps():
    before, after, _ = run(4, 2, None, steps=2)
    np.testing.assert_allclose(after, np.broadcast_to(before.mean(axis=0), after.shape), rtol=0, atol=1e-12)


def test_compressed_rank_one_moves_towards_consensus():
    before, after, results = run(2, 2, 1, steps=8, min_compression=1)
    assert any(r["compressed"] for r in results)
    spread = lambda x: ((x - x.mean(axis=0)) ** 2).sum()  # noqa: E731
    assert spread(after) < 0.5 * spread(before)


def test_exact_variant_bytes_are_bandwidth_optimal_reduce_scatter_and_one_shard_across_nodes():
    nodes, per_node = 2, 4
    _, _, results = run(nodes, per_node, None, steps=1)
    model_bytes = sum(np.prod(s) for s in SHAPES.values()) * 8
    traffic = results[0]["traffic"]
    local = sum(traffic.sent.get(r, 0) for r in range(1, per_node))
    across = traffic.sent[per_node]  # rank 0's partner at step 0: local rank 0 of node 1
    # reduce-scatter and all-gather: (L - 1)/L of the model each; across nodes: one shard, M / L (+ rounding)
    assert abs(local - 2 * (per_node - 1) / per_node * model_bytes) <= 2 * 8 * len(SHAPES) * per_node
    assert abs(across - model_bytes / per_node) <= 8 * len(SHAPES)


def test_shard_bounds_cover_the_buffer_with_sizes_differing_by_at_most_one():
    bounds = shard_bounds(10, 4)
    assert bounds == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_whole_tensor_assignment_balances_largest_first():
    assert assign_whole_tensors([100, 10, 90, 5], 2) == [0, 1, 1, 0]  # loads 100+5 and 90+10


def bind(comm: gossip.Communicator, algorithm: HierarchicalGossip, schedule=None) -> None:
    algorithm.setup(comm, schedule, pack([("w", torch.zeros(4, 4))]))


@pytest.mark.parametrize(
    ("size", "local_size", "message"),
    [(6, 4, "does not divide the world size 6"), (6, 2, "power of two")],
)
def test_bad_layout_is_refused_naming_it(size, local_size, message):
    with pytest.raises(ValueError, match=message):
        gossip.simulate(size, bind, HierarchicalGossip(local_size=local_size))


def test_another_schedule_is_refused_naming_the_expected_one():
    with pytest.raises(ValueError, match=r"topologies.hierarchical\(2, 2\)"):
        gossip.simulate(
            4, lambda comm: bind(comm, HierarchicalGossip(), topologies.one_peer_hypercube(4)), local_size=2
        )


@pytest.mark.parametrize("compress_rank", [0, 1.5, True])
def test_bad_compress_rank_is_refused(compress_rank):
    with pytest.raises(ValueError, match="compress_rank"):
        HierarchicalGossip(compress_rank)
