"""Two MPI ranks sharing one GPU: the wrapper trains a small GPT on CUDA parameters and equals the simulator.

The one multi-rank GPU path a single GPU can show: ``mpiexec -n 2``, ``gossip.init("mpi", mpi_device="cuda")``
(device buffers to MPI directly when the library is CUDA-aware, else staged through pinned host memory), both
ranks on the same device. The simulator's run of the same function on that device is the oracle: messages are
copied exactly either way and every rank runs the same kernels, so parameters and losses agree bit for bit.
``GOSSIP_TEST_DEVICE=cpu`` runs it on the CPU (MPI with host tensors) to check the test itself without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.gpu_mpi_scenario import train_small_gpt
from helpers.launch import launch

import gossip

DEVICE = torch.device(os.environ.get("GOSSIP_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("mpi4py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    out_dir = tmp_path_factory.mktemp("gpu_mpi")
    on_mpi = launch("gpu_mpi_worker.py", out_dir, [DEVICE.type], backend="mpi", n=2, timeout=300.0)[0]
    on_simulator = gossip.simulate(2, train_small_gpt, device=DEVICE, timeout=120.0)
    return on_mpi, on_simulator


def test_both_mpi_ranks_train_on_the_device(runs):
    on_mpi, _ = runs
    for rank, result in enumerate(on_mpi):
        assert result["device"] == {DEVICE.type}, rank
        assert result["comm_device"].startswith(DEVICE.type), rank
        assert result["losses"][-1] < result["losses"][0], (rank, result["losses"])


def test_mpi_on_the_device_equals_the_simulator_bit_for_bit(runs):
    on_mpi, on_simulator = runs
    for rank, (got, expected) in enumerate(zip(on_mpi, on_simulator, strict=True)):
        assert got["losses"] == expected["losses"], f"rank {rank}: losses differ from the simulator's"
        for index, (x, y) in enumerate(zip(got["parameters"], expected["parameters"], strict=True)):
            assert torch.equal(x, y), f"rank {rank}: parameter {index} differs from the simulator's"


def test_the_replicas_differ_so_the_comparison_is_not_vacuous(runs):
    on_mpi, _ = runs
    assert any(not torch.equal(x, y) for x, y in zip(on_mpi[0]["parameters"], on_mpi[1]["parameters"], strict=True))
