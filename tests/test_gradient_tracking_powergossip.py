"""Gradient tracking with compressed trackers, PowerGossip (``gradient_tracking="powergossip"`` or a
``gossip.PowerGossip`` object) and scaled signs (``"sign"``, ``gossip.ChocoSign``): the trackers' sum equals the
gradients' sum after every step, each step sends the parameters' algorithm's bytes plus the trackers' compressed
messages (far below the model), resume is bit-identical, and Gloo and MPI equal the simulator bit for bit (with the
overlapped tracker of test_gradient_tracking_overlap.py too)."""

from __future__ import annotations

import pytest
import torch
from helpers.launch import results_on_backend
from helpers.parallel_scenarios import batch, checkpoint_resume, loss_of, make_mlp, wrap
from helpers.tracking_scenarios import (
    STEPS,
    assert_trackers_sum_to_the_gradients,
    comparison_bytes,
    run_all,
    tracked_steps,
    tracker,
)

import gossip
import topologies
from gossip.errors import ArgumentTypeError, InvalidArgumentError

N = 4


@pytest.mark.parametrize("algorithm", ["exact", "powergossip"])
def test_the_trackers_sum_is_the_gradients_sum_after_every_step(algorithm):
    per_rank = gossip.simulate(N, tracked_steps, algorithm)
    exact_trackers = gossip.simulate(N, tracked_steps, algorithm, True)
    assert_trackers_sum_to_the_gradients(per_rank)
    # compression changed the trackers (they are not the exact mixing's), and they are not the local gradients
    assert not torch.equal(per_rank[0][-1]["y"], exact_trackers[0][-1]["y"])
    assert not torch.equal(per_rank[0][-1]["y"], per_rank[0][-1]["g"])


def test_sign_trackers_keep_the_sum_send_3_bits_a_value_and_resume_bit_for_bit(tmp_path):
    """``gradient_tracking="sign"``: gossip.ChocoSign's antisymmetric per-edge corrections keep sum_i y_i =
    sum_i g_i; every step sends the parameters' PowerGossip plus one message of 3 bits a value and four float32
    scales per 256 values to the hypercube's one peer; a resumed run equals the uninterrupted one bit for bit."""
    per_rank = gossip.simulate(N, tracked_steps, "powergossip", "sign")
    assert_trackers_sum_to_the_gradients(per_rank)
    compressed = gossip.simulate(N, plain_bytes, tracker)
    numel = per_rank[0][0]["x"].numel()  # one bucket: the MLP is smaller than a bucket
    message = 3 * -(-numel // 8) + 4 * 4 * -(-numel // 256)
    for rank in range(N):
        comparison = comparison_bytes("one_peer_hypercube", N, rank, STEPS)
        expected = [c + message + m for c, m in zip(compressed[rank], comparison, strict=True)]
        assert [row["bytes_sent"] for row in per_rank[rank]] == expected, f"rank {rank}"
    for rank, result in enumerate(
        gossip.simulate(N, checkpoint_resume, tmp_path, gossip.PowerGossip, False, gradient_tracking="sign")
    ):
        assert result["resumed_at"] == 3 and torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def plain_bytes(comm, make_algorithm) -> list[int]:
    """The bytes each of ``STEPS`` SGD steps sends without tracking."""
    model = wrap(comm, make_mlp(comm.rank), make_algorithm())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sent = []
    for step in range(STEPS):
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        sent.append(model.metrics.last["bytes_sent"])
    model.close()
    return sent


def test_bytes_per_step_are_the_algorithms_plus_the_trackers_compressed_products():
    """The trackers' PowerGossip has the parameters' layout, so it sends at every step what the same PowerGossip
    mixing the parameters sends: with exact gossip of the parameters, each step is ExactGossip's bytes (the whole
    model to the hypercube's one peer) plus PowerGossip's compressed products, well below the model's size."""
    with_tracking = gossip.simulate(N, tracked_steps, "exact")
    exact_only = gossip.simulate(N, plain_bytes, gossip.ExactGossip)
    compressed = gossip.simulate(N, plain_bytes, tracker)
    model_bytes = with_tracking[0][0]["x"].numel() * 4
    for rank in range(N):
        assert exact_only[rank] == [model_bytes] * STEPS
        assert all(0 < b < model_bytes / 2 for b in compressed[rank])
        comparison = comparison_bytes("one_peer_hypercube", N, rank, STEPS)
        expected = [e + c + m for e, c, m in zip(exact_only[rank], compressed[rank], comparison, strict=True)]
        assert [row["bytes_sent"] for row in with_tracking[rank]] == expected, f"rank {rank}"


def test_resume_with_compressed_trackers_is_bit_identical(tmp_path):
    results = gossip.simulate(
        N, checkpoint_resume, tmp_path, gossip.ExactGossip, False, gradient_tracking="powergossip"
    )
    for rank, result in enumerate(results):
        assert result["resumed_at"] == 3
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def test_the_string_and_the_object_name_the_same_mixing():
    from gossip.wrapper.tracking import tracking_setting

    assert tracking_setting("powergossip") == tracking_setting(gossip.PowerGossip())
    assert tracking_setting(True) == tracking_setting("exact") == "exact"
    assert tracking_setting(False) is False


def _refusal(comm, option) -> str:
    try:
        wrap(comm, make_mlp(comm.rank), gradient_tracking=option).close()
    except (InvalidArgumentError, ArgumentTypeError) as error:
        return str(error)
    return "accepted"


def test_an_unknown_tracking_option_and_the_wrappers_own_algorithm_are_refused():
    assert gossip.simulate(2, _refusal, "compressed")[0].startswith("gradient_tracking must be True, False, one of")

    def same_object(comm) -> str:
        algorithm = gossip.PowerGossip()
        try:
            gossip.DecentralizedDataParallel(
                make_mlp(comm.rank),
                comm,
                topologies.one_peer_hypercube(comm.size),
                algorithm,
                gradient_tracking=algorithm,
            )
        except ArgumentTypeError as error:
            return str(error)
        return "accepted"

    for rank, message in enumerate(gossip.simulate(2, same_object)):
        assert message.startswith(f"rank {rank}: gradient_tracking was given the wrapper's own algorithm object")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("oracle")
    return gossip.simulate(N, lambda comm: run_all(comm, directory / f"checkpoint{comm.rank}"), timeout=60.0)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def real(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return results_on_backend("tracking_worker.py", request.param, tmp_path_factory, n=N)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case",
    [
        "exact",
        "powergossip",
        "overlap-exact-trackers",
        "overlap-powergossip-trackers",
        "momentum-own-v",
        "sign",
        "sign-two-hops",
    ],
)
def test_real_backends_equal_the_simulator_bit_for_bit(real, oracle, case):
    backend, results = real
    for rank in range(N):
        for step, (got, want) in enumerate(zip(results[rank][case], oracle[rank][case], strict=True)):
            for key in ("y", "x", "grad"):
                assert torch.equal(got[key], want[key]), f"{backend} rank {rank} step {step}: {key} differs"
            assert got["bytes_sent"] == want["bytes_sent"]


@pytest.mark.multiprocess
def test_resume_on_real_backends_is_bit_identical_and_equals_the_simulator(real, oracle):
    backend, results = real
    for rank in range(N):
        for case in ("checkpoint", "overlap-checkpoint", "sign-checkpoint", "sign-two-hops-checkpoint"):
            checkpoint = results[rank][case]
            assert torch.equal(checkpoint["resumed"], checkpoint["uninterrupted"]), f"{backend} rank {rank} {case}"
            assert torch.equal(checkpoint["resumed"], oracle[rank][case]["resumed"]), f"{backend} rank {rank} {case}"


@pytest.mark.multiprocess
def test_momentum_tracking_with_the_sampled_second_moment_equals_the_simulator_to_rounding(real, oracle):
    """With the mean gradient's second moment sampled every 2 steps, the backend's all-reduce sums the gradients in
    its own order (as for the other all-reducing algorithms, test_algorithms_backends.py): equal to rounding, and
    resume on the backend bit-identical. With each rank's own second moment ("momentum-own-v", above): bit for bit."""
    backend, results = real
    for rank in range(N):
        for step, (got, want) in enumerate(zip(results[rank]["momentum"], oracle[rank]["momentum"], strict=True)):
            for key in ("y", "x", "grad", "h"):
                where = f"{backend} rank {rank} step {step}: {key}"
                torch.testing.assert_close(
                    got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
                )
            assert got["bytes_sent"] == want["bytes_sent"]
        checkpoint = results[rank]["momentum-checkpoint"]
        assert torch.equal(checkpoint["resumed"], checkpoint["uninterrupted"]), f"{backend} rank {rank}"
        torch.testing.assert_close(checkpoint["resumed"], oracle[rank]["momentum-checkpoint"]["resumed"])
