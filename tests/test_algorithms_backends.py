"""The gossip algorithms on Gloo and MPI (4 processes) produce the simulator's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch
from algorithm_scenarios import CASES, run_all
from launch import launch

import gossip

N = 4


@pytest.fixture(scope="module")
def oracle() -> list[dict]:
    return gossip.simulate(N, run_all, timeout=60.0)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def real(request, tmp_path_factory) -> tuple[str, list[dict]]:
    out_dir = tmp_path_factory.mktemp(request.param)
    return request.param, launch("algorithm_worker.py", out_dir, [request.param], backend=request.param, n=N)[0]


@pytest.mark.parametrize("case", [f"{a}/{s}" for a, s in CASES])
def test_real_backend_mixes_exactly_like_the_simulator(real, oracle, case):
    backend, results = real
    for rank in range(N):
        got, want = results[rank][case], oracle[rank][case]
        if case.startswith("allreduce"):  # the backend's reduction order may differ from rank order
            for g, w in zip(got["buffers"], want["buffers"], strict=True):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            continue
        for g, w in zip(got["buffers"], want["buffers"], strict=True):
            assert torch.equal(g, w), f"{backend} rank {rank} {case}: parameters differ from the simulator's"
        for g, w in zip(got["factors"], want["factors"], strict=True):
            assert g.keys() == w.keys()
            for key in g:
                assert g[key][0] == w[key][0]
                assert all(torch.equal(a, b) for a, b in zip(g[key][1] + g[key][2], w[key][1] + w[key][2], strict=True))


@pytest.mark.parametrize("case", [f"{a}/{s}" for a, s in CASES if not a.startswith("allreduce")])
def test_algorithm_byte_counts_equal_the_communicators(real, case):
    backend, results = real
    for rank in range(N):
        result = results[rank][case]
        assert result["sent"] == result["comm_sent"] and result["received"] == result["comm_received"], (
            f"{backend} rank {rank} {case}"
        )
