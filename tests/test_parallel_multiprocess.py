"""DecentralizedDataParallel on 4 real processes (Gloo, and MPI via mpiexec -n 4), one job per backend.

Every scenario of parallel_scenarios.py runs in the job; the results must equal the simulator's run of the same
scenarios (same seeds, one thread): exact gossip with weights 1/2 and SGD involve no reduction whose order
depends on the backend, so the parameters agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from helpers.launch import results_on_backend
from helpers.parallel_scenarios import run_all

import gossip

N = 4


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> list[dict]:
    torch.set_num_threads(1)
    return gossip.simulate(N, run_all, tmp_path_factory.mktemp("simulator"), timeout=60.0)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def results(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return results_on_backend("parallel_worker.py", request.param, tmp_path_factory, n=N)


def test_loss_falls(results):
    backend, per_rank = results
    first = sum(r["train"]["losses"][0] for r in per_rank) / N
    last = sum(r["train"]["losses"][-1] for r in per_rank) / N
    assert last < 0.8 * first, f"{backend}: mean loss {first:.4f} -> {last:.4f}"


def test_trained_parameters_equal_the_simulators(results, oracle):
    backend, per_rank = results
    for rank in range(N):
        got, expected = per_rank[rank]["train"]["params"], oracle[rank]["train"]["params"]
        assert torch.equal(got, expected), f"{backend} rank {rank}: max diff {(got - expected).abs().max():.3g}"


def test_losses_equal_the_simulators(results, oracle):
    backend, per_rank = results
    for rank in range(N):
        assert per_rank[rank]["train"]["losses"] == oracle[rank]["train"]["losses"], f"{backend} rank {rank}"


def test_bytes_per_step_equal_the_simulators(results, oracle):
    _, per_rank = results
    for rank in range(N):
        got, expected = per_rank[rank]["train"]["metrics"], oracle[rank]["train"]["metrics"]
        assert (got["bytes_sent"], got["bytes_received"]) == (expected["bytes_sent"], expected["bytes_received"])
        assert got["bytes_sent"] == 4 * sum(p.numel() for p in [per_rank[rank]["train"]["params"]])


def test_resume_from_checkpoint_is_bit_identical(results):
    backend, per_rank = results
    for rank, result in enumerate(per_rank):
        checkpoint = result["checkpoint"]
        assert checkpoint["resumed_at"] == 3
        assert torch.equal(checkpoint["resumed"], checkpoint["uninterrupted"]), f"{backend} rank {rank}"


def test_averaged_restores_the_replicas_bit_identically(results):
    backend, per_rank = results
    for rank, result in enumerate(per_rank):
        averaged = result["averaged"]
        assert torch.equal(averaged["after"], averaged["before"]), f"{backend} rank {rank}"


def test_averaged_holds_the_global_mean_and_consensus_matches_the_simulator(results, oracle):
    backend, per_rank = results
    mean = torch.stack([r["averaged"]["before"] for r in per_rank]).double().mean(0)
    for rank, result in enumerate(per_rank):
        torch.testing.assert_close(result["averaged"]["inside"].double(), mean, rtol=1e-6, atol=1e-6)
        expected = oracle[rank]["averaged"]["consensus"]
        assert result["averaged"]["consensus"] == pytest.approx(expected, rel=1e-9), f"{backend} rank {rank}"


def test_a_grad_scaler_skip_on_one_rank_keeps_lockstep_as_on_the_simulator(results, oracle):
    backend, per_rank = results
    for rank in range(N):
        (params, steps), (expected, _) = per_rank[rank]["grad_scaler_skip"], oracle[rank]["grad_scaler_skip"]
        assert steps == 5 and torch.equal(params, expected), f"{backend} rank {rank}"


def test_a_closed_communicator_is_refused_by_the_wrapper(results):
    backend, per_rank = results
    for rank, result in enumerate(per_rank):
        expected = f"rank {rank}: the communicator was already closed (comm.close()); create a new one with"
        assert result["closed"].startswith(expected), f"{backend}: {result['closed']}"


def test_gradient_tracking_equals_the_simulator_bit_for_bit(results, oracle):
    backend, per_rank = results
    for rank in range(N):
        got, expected = per_rank[rank]["tracking"], oracle[rank]["tracking"]
        assert torch.equal(got["params"], expected["params"]), f"{backend} rank {rank}"
        assert got["losses"] == expected["losses"], f"{backend} rank {rank}"
        # parameters and trackers: two exact exchanges of the model per step
        sent = (got["metrics"]["bytes_sent"], expected["metrics"]["bytes_sent"])
        assert sent == (2 * 4 * got["params"].numel(),) * 2, f"{backend} rank {rank}"


def test_resume_with_gradient_tracking_is_bit_identical(results, oracle):
    backend, per_rank = results
    for rank, result in enumerate(per_rank):
        checkpoint = result["tracking_checkpoint"]
        assert checkpoint["resumed_at"] == 3
        assert torch.equal(checkpoint["resumed"], checkpoint["uninterrupted"]), f"{backend} rank {rank}"
        assert torch.equal(checkpoint["resumed"], oracle[rank]["tracking_checkpoint"]["resumed"]), f"rank {rank}"


def test_powergossip_with_a_delayed_last_iteration_equals_the_simulator_and_resumes_bit_identically(results, oracle):
    backend, per_rank = results
    for rank in range(N):
        got, expected = per_rank[rank]["delayed"], oracle[rank]["delayed"]
        assert torch.equal(got["params"], expected["params"]), f"{backend} rank {rank}"
        assert got["losses"] == expected["losses"], f"{backend} rank {rank}"
        checkpoint = per_rank[rank]["delayed_checkpoint"]
        assert checkpoint["resumed_at"] == 3
        assert torch.equal(checkpoint["resumed"], checkpoint["uninterrupted"]), f"{backend} rank {rank}"
        assert torch.equal(checkpoint["resumed"], oracle[rank]["delayed_checkpoint"]["resumed"]), f"rank {rank}"


def test_two_wrappers_on_one_communicator_do_not_cross_and_equal_the_simulator(results, oracle):
    """A model and a critic, each wrapped by the default pipeline on the same communicator and stepped in turn:
    the model trains as it does wrapped alone (on the simulator), and both equal the simulator on the backend."""
    backend, per_rank = results
    for rank in range(N):
        expected = oracle[rank]["two_wrappers"]
        assert torch.equal(expected["first"], expected["alone"]), f"simulator rank {rank}"
        got = per_rank[rank]["two_wrappers"]
        for name in ("first", "critic", "alone"):
            assert torch.equal(got[name], expected[name]), f"{backend} rank {rank}: {name}"
