"""gossip.OuterOptimizer on Gloo and MPI (4 processes): the simulator's numbers, bit for bit where the
pseudo-gradients travel by gossip (exact or PowerGossip, with per-step gossip between, delayed, on a schedule of
their own), to rounding where they are all-reduced (a backend sums in its own order, as for DiLoCo in
test_algorithms_backends.py); the bytes booked are the communicator's."""

from __future__ import annotations

import pytest
import torch
from helpers.launch import results_on_backend
from helpers.outer_scenarios import CASES, run_all

import gossip
from gossip.algorithms.base import COLLECTIVE

N = 4


@pytest.fixture(scope="module")
def oracle() -> list[dict]:
    return gossip.simulate(N, run_all, timeout=60.0)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def real(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return results_on_backend("outer_worker.py", request.param, tmp_path_factory, n=N)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_real_backend_equals_the_simulator(real, oracle, case):
    backend, results = real
    all_reduces = CASES[case][2]
    for rank in range(N):
        got, want = results[rank][case], oracle[rank][case]
        for step, (g, w) in enumerate(zip(got["replicas"], want["replicas"], strict=True)):
            if all_reduces:
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(g, w), f"{backend} rank {rank} {case} step {step}: differs from the simulator"
        for g, w in zip(got["theta"], want["theta"], strict=True):
            if all_reduces:
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(g, w), f"{backend} rank {rank} {case}: anchor differs from the simulator"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_booked_are_the_communicators(real, case):
    backend, results = real
    for rank in range(N):
        result = results[rank][case]
        sent = dict(result["sent"])
        assert (COLLECTIVE in sent) == CASES[case][2]
        sent.pop(COLLECTIVE, None)
        assert sent == result["comm_sent"], f"{backend} rank {rank} {case}"
