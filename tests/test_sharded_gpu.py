"""Sharded replicas on a GPU: FSDP2 on CUDA, the lanes on NCCL, the default pipeline's parts. Skipped without CUDA.

tests/helpers/sharded_device_worker.py runs a world of one (1 replica x 1 shard: one GPU cannot hold two NCCL ranks;
the 2 x 2 layouts are the CPU tests') through the staging, the trackers of the local shards, momentum tracking on
DTensors, ``averaged()`` and a DCP checkpoint. ``GOSSIP_TEST_DEVICE=cpu`` runs it on the CPU (Gloo) to check the
test itself without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers.launch import TEST_DEVICE, device_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(TEST_DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return device_job("sharded_device_worker.py", tmp_path_factory.mktemp("sharded-device"))


def test_the_shards_live_on_the_device_and_the_lanes_on_its_backend(run):
    assert run["parameters"] == [TEST_DEVICE]
    assert run["lane"] == ("nccl" if TEST_DEVICE == "cuda" else "gloo")
    assert run["placements"] == ["(Shard(dim=0),)"]


def test_the_pipelines_parts_train_the_shards(run):
    losses = run["losses"]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_the_average_of_one_replica_is_itself_and_resume_is_bit_exact(run):
    assert all(torch.equal(a, b) for a, b in zip(run["averaged"], run["uninterrupted"], strict=True))
    assert run["resumed_at"] == 8
    assert all(torch.equal(a, b) for a, b in zip(run["resumed"], run["uninterrupted"], strict=True))
