"""Sharded replicas with the lanes on MPI: ``gossip.init_lanes(mesh, backend="mpi")`` under ``mpiexec -n 4``.

2 replicas x 2 FSDP2 shards (FSDP2 on Gloo, started with the MPI ranks); the lane and shard communicators are
mpi4py communicators split from ``COMM_WORLD``. The same comparisons with unsharded replicas as on Gloo
(tests/test_sharded.py) hold on them: exact gossip and momentum tracking.
"""

from __future__ import annotations

import pytest
import torch
from helpers.launch import launch

N = 4


def _close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-6) -> bool:
    return all(torch.allclose(x, y, rtol=0.0, atol=atol) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    return launch("sharded_mpi_worker.py", tmp_path_factory.mktemp("sharded-mpi"), [], backend="mpi", n=N)[0]


@pytest.mark.multiprocess
def test_the_lanes_are_mpi_communicators_split_by_lane_and_by_replica(per_rank):
    for rank, result in enumerate(per_rank):
        assert result["communicators"] == ("MPICommunicator", "MPICommunicator")
        assert (result["replica"], result["shard"], result["sizes"]) == (rank // 2, rank % 2, (2, 2))
        assert result["replica_ranks"] == (2 * (rank // 2), 2 * (rank // 2) + 1)


@pytest.mark.multiprocess
def test_exact_gossip_over_mpi_lanes_equals_unsharded_gossip_of_the_same_replicas(per_rank):
    for result in per_rank:
        run = result["exact"]
        for step, (full, expected) in enumerate(zip(run["full"], run["expected_full"], strict=True)):
            assert _close(full, expected), (result["replica"], result["shard"], step)
        assert result["steps_after_skip"] == 5
    assert not _close(per_rank[0]["exact"]["full"][-1], per_rank[2]["exact"]["full"][-1], atol=1e-3)


@pytest.mark.multiprocess
def test_momentum_tracking_over_mpi_lanes_equals_the_unsharded_wrappers(per_rank):
    for result in per_rank:
        run = result["momentum"]
        assert run["samples"][3:5] == [0, 1]
        for step, (full, expected) in enumerate(zip(run["full"], run["expected_full"], strict=True)):
            assert _close(full, expected), (result["replica"], step)
