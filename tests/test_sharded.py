"""Gossip between FSDP2-sharded replicas (2 replicas x 2 shards, Gloo on CPU): one 4-process job, its properties."""

from __future__ import annotations

import pytest
import torch
from helpers.launch import launch

N = 4


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    return launch("sharded_worker.py", tmp_path_factory.mktemp("sharded"), [], backend="gloo", n=N)[0]


def test_unsharded_wrapper_refuses_dtensor_parameters_by_name(per_rank):
    for result in per_rank:
        assert result["refusal"].startswith("ShardedLayoutError"), result["refusal"]
        assert "ShardedDecentralizedDataParallel" in result["refusal"]


def test_exact_gossip_preserves_the_sum_over_replicas_and_averages_them(per_rank):
    for rank in range(N):
        before = [sum(per_rank[r]["before"][i] for r in (rank % 2, rank % 2 + 2)) for i in range(4)]
        after = [sum(per_rank[r]["after"][i] for r in (rank % 2, rank % 2 + 2)) for i in range(4)]
        assert all(torch.allclose(a, b) for a, b in zip(after, before, strict=True)), rank
        assert not torch.equal(per_rank[0]["before"][0], per_rank[2]["before"][0])  # the replicas differed
        assert all(torch.allclose(a, b) for a, b in zip(per_rank[0]["after"], per_rank[2]["after"], strict=True))
        assert per_rank[rank]["consensus"] < 1e-6


def test_mixed_parameters_stay_the_same_shard0_dtensors(per_rank):
    for result in per_rank:
        assert result["same_objects"] and result["same_storage"]
        assert result["placements"] == ["(Shard(dim=0),)"] * 4
