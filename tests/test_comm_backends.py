"""The communicator's behavioural suite on the simulator, on Gloo (4 processes) and on MPI (mpiexec -n 4).

Each real backend runs every scenario of comm_scenarios.py in one job; its results must equal the simulator's
bit for bit where the operation is exact, and each result is also checked against what was sent.
"""

from __future__ import annotations

import pytest
import torch
from helpers.comm_scenarios import BIG_NUMEL, DTYPES, SIZES, run_all
from helpers.launch import launch

import gossip

N = 4
BACKENDS = ("simulator", "gloo", "mpi", "mpi-staged")


@pytest.fixture(scope="module")
def oracle() -> list[dict]:
    return gossip.simulate(N, run_all, timeout=30.0)


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, oracle, tmp_path_factory) -> tuple[str, list[dict]]:
    if request.param == "simulator":
        return "simulator", oracle
    out_dir = tmp_path_factory.mktemp(request.param)
    launcher = "mpi" if request.param == "mpi-staged" else request.param
    return request.param, launch("comm_worker.py", out_dir, [request.param], backend=launcher, n=N)[0]


def scenario(results: tuple[str, list[dict]], name: str) -> list[dict]:
    backend, per_rank = results
    for rank, result in enumerate(per_rank):
        assert "exception" not in result[name], f"{backend} rank {rank}: {result[name]['exception']}"
    return [result[name] for result in per_rank]


def test_exchange_with_1_to_3_peers_delivers_what_was_sent(results):
    for rank, result in enumerate(scenario(results, "exchange_with_k_peers")):
        for k in (1, 2, 3):
            for dtype in DTYPES:
                for numel in SIZES:
                    assert result[f"k={k} {dtype} n={numel} ok"], f"{results[0]} rank {rank} k={k} {dtype} {numel}"


@pytest.mark.parametrize("name", ["exchange_with_k_peers", "exchange_64mb"])
def test_received_bytes_equal_the_simulators(results, oracle, name):
    got = scenario(results, name)
    for rank in range(N):
        digests = {k: v for k, v in got[rank].items() if k != "seconds"}
        assert digests == {k: v for k, v in oracle[rank][name].items() if k != "seconds"}, f"rank {rank}"


def test_64mb_exchange_arrives_intact(results):
    assert all(r["ok"] for r in scenario(results, "exchange_64mb")), f"{BIG_NUMEL * 4} bytes"


def test_several_tensors_to_one_peer_arrive_in_order(results):
    for rank, result in enumerate(scenario(results, "several_tensors_per_peer")):
        peer = rank ^ 1
        first, second = result["received"]
        assert first.dtype == torch.float64 and second.dtype == torch.int64
        assert torch.equal(first, torch.arange(7, dtype=torch.float64) + 1000 * peer + 10 * rank)
        assert torch.equal(second, torch.arange(3) + 1000 * peer + 10 * rank)


def test_all_reduce_sums_and_averages(results, oracle):
    expected = sum(torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(N))
    for rank, result in enumerate(scenario(results, "collectives")):
        torch.testing.assert_close(result["sum"], expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result["avg"], expected / N, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result["sum"], oracle[rank]["collectives"]["sum"], rtol=1e-6, atol=1e-6)
        assert torch.equal(result["ints"], torch.arange(10) * sum(range(1, N + 1)))
        assert torch.equal(result["bf16"], torch.full((4,), 5.0, dtype=torch.bfloat16))


def test_broadcast_and_all_gather_object(results):
    for rank, result in enumerate(scenario(results, "collectives")):
        assert torch.equal(result["broadcast"], torch.full((5,), 2.0))
        assert result["gathered"] == [{"rank": r, "name": f"r{r}"} for r in range(N)]
        assert result["local"] == (rank, N)


def test_exchange_progresses_while_the_main_thread_computes(results):
    """Completion was observed by polling done() from a compute loop that never calls the communicator."""
    for rank, result in enumerate(scenario(results, "background_progress")):
        assert result["ok"], f"rank {rank}: wrong data"
        assert result["completed_while_computing"], f"{results[0]} rank {rank} needed wait() to progress"


def test_timeout_names_the_peer_that_never_sent(results):
    failures = scenario(results, "failures")
    message = failures[0]["error"]
    assert message.startswith("CommTimeoutError"), message
    assert "rank 0:" in message and "receive from peer 1" in message, message
    # rank 1 waited longer: it times out too, or sees rank 0 leave; either way it names rank 0
    assert "rank 1:" in failures[1]["error"] and "peer 0" in failures[1]["error"], failures[1]["error"]


def test_dtype_mismatch_is_refused_naming_peer_and_both_specs(results):
    failures = scenario(results, "failures")
    message = failures[2]["error"]
    assert message.startswith("ExchangeMismatchError"), message
    assert "peer 3" in message and "float64[10]" in message and "float32[10]" in message, message
    # the sender learns of it as a timeout or a closed connection, naming the receiver
    assert "peer 2" in failures[3]["error"], failures[3]["error"]


def test_communicator_refuses_work_after_a_failure(results):
    for rank, result in enumerate(scenario(results, "failures")):
        assert "unusable after an earlier failure" in result["after"], f"rank {rank}: {result['after']}"


@pytest.mark.parametrize("results", ["mpi-staged"], indirect=True)
def test_staging_through_host_buffers_is_said_once_per_rank(results):
    kind = "pinned" if torch.cuda.is_available() else "plain"
    for rank, result in enumerate(results[1]):
        message = f"rank {rank}: MPI: cpu tensors are staged through {kind} host buffers: forced (stage=True)"
        assert result["log"] == [message]
