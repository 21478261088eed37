"""Hierarchical gossip on Gloo and MPI (4 processes = 2 nodes x 2) gives the simulator's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers.hierarchical_worker import CASES, LOCAL_SIZE, run_all
from helpers.launch import launch

import gossip

N = 4


@pytest.fixture(scope="module")
def oracle() -> list[dict]:
    return gossip.simulate(N, run_all, local_size=LOCAL_SIZE, timeout=60.0)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def real(request, tmp_path_factory) -> tuple[str, list[dict]]:
    out_dir = tmp_path_factory.mktemp(f"hierarchical-{request.param}")
    results, _ = launch(
        "hierarchical_worker.py", out_dir, [request.param], backend=request.param, n=N, local_size=LOCAL_SIZE
    )
    return request.param, results


def test_gloo_launch_reports_two_ranks_per_node(real):
    backend, results = real
    if backend == "gloo":
        assert [r["local_size"] for r in results] == [LOCAL_SIZE] * N
    else:  # MPICH on one host: every rank is local; the worker passes local_size=2 to the algorithm
        assert [r["local_size"] for r in results] == [N] * N


@pytest.mark.parametrize("case", list(CASES))
def test_real_backend_mixes_hierarchically_like_the_simulator(real, oracle, case):
    backend, results = real
    for rank in range(N):
        got, want = results[rank][case], oracle[rank][case]
        for g, w in zip(got["buffers"], want["buffers"], strict=True):
            assert torch.equal(g, w), f"{backend} rank {rank} {case}: parameters differ from the simulator's"
        assert got["factors"].keys() == want["factors"].keys()
        assert case == "exact" or any(want["factors"].values()), "the compressed cases must compress something"
        for key in got["factors"]:
            assert all(torch.equal(a, b) for a, b in zip(got["factors"][key], want["factors"][key], strict=True))
        assert (got["sent"], got["received"]) == (want["sent"], want["received"]), f"{backend} rank {rank} {case}"
