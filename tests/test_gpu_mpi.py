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
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """MPI with PowerGossip's kernels as CUDA graphs and one by one, and the simulator (one by one: its ranks are
    threads, which cannot capture)."""
    found = {}
    for graphs in ("1", "0"):
        out_dir = tmp_path_factory.mktemp(f"gpu_mpi_graphs{graphs}")
        found[f"mpi{graphs}"] = launch(
            "gpu_mpi_worker.py", out_dir, [DEVICE.type, graphs], backend="mpi", n=2, timeout=300.0
        )[0]
    found["simulator"] = gossip.simulate(2, train_small_gpt, device=DEVICE, timeout=120.0)
    return found


def test_both_mpi_ranks_train_on_the_device(runs):
    for rank, result in enumerate(runs["mpi1"]):
        assert result["device"] == {DEVICE.type}, rank
        assert result["comm_device"].startswith(DEVICE.type), rank
        assert result["losses"][-1] < result["losses"][0], (rank, result["losses"])


def test_real_ranks_on_cuda_run_powergossip_as_cuda_graphs(runs):
    if DEVICE.type != "cuda":
        pytest.skip("CUDA graphs exist only on a CUDA device")
    for rank in range(2):
        # one peer (a hypercube of 2) x 2 sides x (products, difference, update)
        assert runs["mpi1"][rank]["graphs"] == 6, runs["mpi1"][rank]["graphs"]
        assert runs["mpi0"][rank]["graphs"] is None and runs["simulator"][rank]["graphs"] is None


@pytest.mark.parametrize("mpi", ["mpi1", "mpi0"])
def test_mpi_on_the_device_equals_the_simulator_bit_for_bit(runs, mpi):
    for rank, (got, expected) in enumerate(zip(runs[mpi], runs["simulator"], strict=True)):
        assert got["losses"] == expected["losses"], f"{mpi}: rank {rank}: losses differ from the simulator's"
        for index, (x, y) in enumerate(zip(got["parameters"], expected["parameters"], strict=True)):
            assert torch.equal(x, y), f"{mpi}: rank {rank}: parameter {index} differs from the simulator's"


def test_the_replicas_differ_so_the_comparison_is_not_vacuous(runs):
    one, other = runs["mpi1"]
    assert any(not torch.equal(x, y) for x, y in zip(one["parameters"], other["parameters"], strict=True))


@pytest.fixture(scope="module")
def progress_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """The main job's PowerGossip (2 iterations, float16 products) with CUDA graphs: MPI with the second iteration
    run during backward (from the backward hooks' thread) and in finish, and the simulator during backward."""
    found = {}
    for during in ("1", "0"):
        out_dir = tmp_path_factory.mktemp(f"gpu_mpi_progress{during}")
        found[f"mpi{during}"] = launch(
            "gpu_mpi_worker.py", out_dir, [DEVICE.type, "1", "2", during], backend="mpi", n=2, timeout=300.0
        )[0]
    found["simulator"] = gossip.simulate(2, train_small_gpt, True, 2, True, device=DEVICE, timeout=120.0)
    return found


def test_iterations_during_backward_on_the_device_are_bit_identical_and_run_as_cuda_graphs(progress_runs):
    from helpers.gpu_mpi_scenario import STEPS

    for rank in range(2):
        during, in_finish, simulated = (progress_runs[key][rank] for key in ("mpi1", "mpi0", "simulator"))
        assert during["ahead"] == STEPS and simulated["ahead"] == STEPS and in_finish["ahead"] == 0, rank
        if DEVICE.type == "cuda":  # each sequence of the step captured once, on the plans or on their twins
            assert during["graphs"] == in_finish["graphs"] == 6, (rank, during["graphs"], in_finish["graphs"])
        for other in (in_finish, simulated):
            assert other["losses"] == during["losses"], rank
            assert all(torch.equal(x, y) for x, y in zip(during["parameters"], other["parameters"], strict=True))
