"""The gossip algorithms on Gloo and MPI (4 processes) produce the simulator's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers.algorithm_scenarios import CASES, run_all
from helpers.launch import results_on_backend

import gossip
from gossip.algorithms.allreduce import COLLECTIVE

N = 4
#: The cases that all-reduce: equal to the simulator to rounding (a backend sums in its own order).
ALL_REDUCING = ("allreduce", "pga", "diloco")


@pytest.fixture(scope="module")
def oracle() -> list[dict]:
    return gossip.simulate(N, run_all, timeout=60.0)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def real(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return results_on_backend("algorithm_worker.py", request.param, tmp_path_factory, n=N)


@pytest.mark.parametrize("case", [f"{a}/{s}" for a, s in CASES])
def test_real_backend_mixes_exactly_like_the_simulator(real, oracle, case):
    backend, results = real
    for rank in range(N):
        got, want = results[rank][case], oracle[rank][case]
        if case.startswith(ALL_REDUCING):  # the backend's reduction order may differ from rank order
            for g, w in zip(got["buffers"], want["buffers"], strict=True):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            for g, w in zip(got["factors"], want["factors"], strict=True):
                assert g.keys() == w.keys()
                for key in g:
                    assert g[key][0] == w[key][0]
                    torch.testing.assert_close(g[key][1] + g[key][2], w[key][1] + w[key][2], rtol=1e-5, atol=1e-5)
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
    """Point-to-point bytes per peer equal the communicator's counters; PeriodicAverage's and DiLoCo's all-reduce
    bytes are recorded under COLLECTIVE, which the communicator does not count."""
    backend, results = real
    for rank in range(N):
        result = results[rank][case]
        sent, received = dict(result["sent"]), dict(result["received"])
        assert (COLLECTIVE in sent) == case.startswith(("pga", "diloco"))
        sent.pop(COLLECTIVE, None)
        received.pop(COLLECTIVE, None)
        assert sent == result["comm_sent"] and received == result["comm_received"], f"{backend} rank {rank} {case}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [f"{a}/{s}" for a, s in CASES if a.startswith(("pga", "diloco"))])
def test_periodic_average_leaves_bit_identical_replicas_and_edge_factors(real, case):
    """The last step averages (DiLoCo: takes an outer step): every rank holds the same bits; PowerGossip's
    factors are the same on both ends of every edge after every step, averaging steps included."""
    backend, results = real
    for rank in range(1, N):
        assert all(
            torch.equal(a, b) for a, b in zip(results[rank][case]["buffers"], results[0][case]["buffers"], strict=True)
        ), f"{backend} {case}: rank {rank}'s replica differs from rank 0's after the global average"
    for step in range(len(results[0][case]["factors"])):
        for rank, result in enumerate(results):
            for (lo, hi), (iteration, p, q) in result[case]["factors"][step].items():
                other = results[hi if rank == lo else lo][case]["factors"][step][(lo, hi)]
                assert iteration == other[0] and all(
                    torch.equal(a, b) for a, b in zip(p + q, other[1] + other[2], strict=True)
                ), f"{backend} {case} step {step}: edge {(lo, hi)} differs between its ends"


@pytest.mark.parametrize("real", ["gloo"], indirect=True)  # MPI checks every header: no header rounds to count
@pytest.mark.parametrize("case", ["powergossip-r1/ring", "powergossip-r2-2it/hypercube"])
def test_powergossip_alternating_messages_settle_into_steady_exchanges_on_gloo(real, case):
    """PowerGossip's messages alternate between the left and right products, two sizes: once the alternation has
    repeated with a peer (4 exchanges), the per-tensor headers stop (no header round trip, under NCCL no host
    sync). Here every peer is met with two exchanges per step on both schedules, so steps 4 and 5 are steady."""
    _, results = real
    for rank in range(N):
        handshakes = results[rank][case]["handshakes"]
        assert handshakes[:2] != [0, 0] and handshakes[-2:] == [0, 0], f"rank {rank}: {handshakes}"
