"""GPU tier: the communicator suite on NCCL with 4 processes, one GPU each. Skipped where no 4 GPUs exist."""

import pytest
import torch
from helpers.comm_scenarios import run_all
from helpers.launch import launch

import gossip

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="the NCCL tier needs 4 CUDA devices")
def test_nccl_matches_the_simulator(tmp_path):
    results = launch("comm_worker.py", tmp_path, ["nccl"], backend="gloo", n=4)[0]
    oracle = gossip.simulate(4, run_all, timeout=30.0)
    for rank in range(4):
        for name in ("exchange_with_k_peers", "exchange_64mb"):
            got = {k: v for k, v in results[rank][name].items() if k != "seconds"}
            assert got == {k: v for k, v in oracle[rank][name].items() if k != "seconds"}
