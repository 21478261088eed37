"""PowerGossip's further power iterations run during backward (``PowerGossip.progress``) change no bit.

Properties: the parameters after training with iterations during backward equal those without, bit for bit, for
1, 2 and 3 iterations and float16 messages, whether the iterations ran during backward or not; an iteration is
posted during backward exactly when the previous one's exchange has completed (the handles decide, not timing:
see tests/helpers/progress_scenarios.py); close() with an iteration in flight and a checkpoint saved with one in
flight give the results of the run without it; the default Algorithm has nothing to progress; Gloo and MPI equal the
simulator bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from helpers.algorithm_scenarios import local_model
from helpers.launch import launch
from helpers.progress_scenarios import (
    EVERY,
    STEPS,
    averaged_mid_step,
    checkpoint_in_flight,
    close_in_flight,
    powergossip,
    run_all,
    train,
)

import gossip
import topologies
from gossip.algorithms import PowerGossipTuning

N = 4


def equal(a: list[dict], b: list[dict], key: str = "params") -> bool:
    return all(torch.equal(x[key], y[key]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("iterations", "message_dtype"), [(1, None), (2, None), (2, torch.float16), (3, None)])
def test_iterations_during_backward_leave_every_parameter_bit_identical(iterations, message_dtype):
    during = gossip.simulate(N, train, iterations, True, message_dtype)
    in_finish = gossip.simulate(N, train, iterations, False, message_dtype)
    assert equal(during, in_finish)
    for result in during:
        # each step's first backward hook finds the first exchange complete and posts the second iteration; a
        # third is posted there too when the second has arrived before backward ends (timing), else in finish
        assert STEPS * min(iterations - 1, 1) <= result["ahead"] <= STEPS * (iterations - 1)
    assert all(result["ahead"] == 0 for result in in_finish)


@pytest.mark.parametrize("composite", ["outer", "periodic"])
def test_inside_the_main_jobs_outer_step_or_a_periodic_average_the_iterations_run_during_backward_too(composite):
    during = gossip.simulate(N, train, 2, True, torch.float16, True, composite)
    in_finish = gossip.simulate(N, train, 2, False, torch.float16, True, composite)
    assert equal(during, in_finish)
    gossip_steps = sum(1 for step in range(STEPS) if (step + 1) % EVERY)  # the others are exact averages
    for result in during:
        assert result["ahead"] == gossip_steps
    assert all(result["ahead"] == 0 for result in in_finish)
    # and the composite does change the result: the comparison above can see a difference
    assert not equal(during, gossip.simulate(N, train, 2, True, torch.float16))


def test_without_waiting_whatever_ran_during_backward_the_result_is_the_same():
    assert equal(
        gossip.simulate(N, train, 2, True, torch.float16, False), gossip.simulate(N, train, 2, False, torch.float16)
    )


def test_a_training_run_does_differ_from_one_with_another_number_of_iterations():
    # the comparison above can see a difference: the second iteration moves the parameters
    assert not equal(gossip.simulate(N, train, 2, True), gossip.simulate(N, train, 1, True))


def progress_before_the_peer_posts(comm) -> tuple[bool, bool, int, int]:
    """Rank 0 asks for progress before its peer has started the step; then after the first exchange arrived."""
    algorithm = powergossip(2, True)
    buckets = local_model(comm.rank)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    if comm.rank == 0:
        pending = algorithm.start(0)
        done_early, more = pending.handle.done(), algorithm.progress(pending)
        ahead_early = algorithm.posted_ahead
        comm.barrier()
    else:
        comm.barrier()
        pending = algorithm.start(0)
    pending.handle.wait()
    more_late, ahead_late = algorithm.progress(pending), algorithm.posted_ahead
    algorithm.finish(pending)
    early = (not done_early and more and ahead_early == 0) if comm.rank == 0 else True
    return early, more_late, ahead_late, algorithm.edges[(0, 1)].iteration


def test_the_second_iteration_is_posted_exactly_when_the_first_exchange_has_completed():
    results = gossip.simulate(2, progress_before_the_peer_posts)
    for rank, (waited_for_the_peer, more, ahead, iteration) in enumerate(results):
        assert waited_for_the_peer, rank  # rank 0: not complete yet, nothing posted, more to do later
        assert more is False and ahead == 1, rank  # once complete: the second (last) iteration posted
        assert iteration == 2, rank  # both iterations applied by finish


def test_nothing_to_progress_with_one_iteration_a_delay_the_switch_off_or_the_default_algorithm():
    def asks(comm, make):
        algorithm = make()
        algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), local_model(comm.rank))
        pending = algorithm.start(0)
        pending_done = pending.handle if hasattr(pending, "handle") else None
        comm.barrier()
        if pending_done is not None:
            pending_done.wait()
        answer = algorithm.progress(pending)
        algorithm.finish(pending)
        algorithm.drain()
        return answer, getattr(algorithm, "posted_ahead", 0)

    makes = [
        lambda: gossip.PowerGossip(num_iterations=1),
        lambda: gossip.PowerGossip(num_iterations=2, delayed_last_iteration=True),
        lambda: gossip.PowerGossip(num_iterations=2, tuning=PowerGossipTuning(iterations_during_backward=False)),
        gossip.ExactGossip,
    ]
    for make in makes:
        assert gossip.simulate(2, asks, make) == [(False, 0)] * 2


def test_the_switch_is_on_by_default_and_not_part_of_the_config():
    assert PowerGossipTuning().iterations_during_backward is True
    off = PowerGossipTuning(iterations_during_backward=False)
    assert gossip.PowerGossip(num_iterations=2).config() == gossip.PowerGossip(num_iterations=2, tuning=off).config()


def test_close_with_an_iteration_in_flight_mixes_as_without_it():
    during = gossip.simulate(N, close_in_flight, True)
    in_finish = gossip.simulate(N, close_in_flight, False)
    assert equal(during, in_finish)
    for result in during:
        assert result["ahead_before_close"] == 3  # step 2's second iteration was in flight at close()
        assert result["steps"] == 3


def test_a_collective_mid_step_lets_every_rank_post_what_a_peer_posted_early():
    mixed = gossip.simulate(N, averaged_mid_step, True)
    none = gossip.simulate(N, averaged_mid_step, False)
    assert equal(mixed, none) and equal(mixed, none, "averages")
    for rank, result in enumerate(mixed):
        # even ranks post during backward; odd ones post before averaged()'s collective, on demand
        assert result["ahead"] == STEPS, rank


def test_a_checkpoint_with_an_iteration_in_flight_resumes_bit_identically(tmp_path):
    for rank, result in enumerate(gossip.simulate(N, checkpoint_in_flight, tmp_path)):
        assert result["in_flight"], rank
        assert result["resumed_at"] == 3, rank
        assert torch.equal(result["continued"], result["uninterrupted"]), rank
        assert torch.equal(result["resumed"], result["uninterrupted"]), rank


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> list[dict]:
    torch.set_num_threads(1)
    return gossip.simulate(N, run_all, tmp_path_factory.mktemp("simulator"), timeout=60.0)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_gloo_and_mpi_equal_the_simulator_bit_for_bit(backend, oracle, tmp_path):
    per_rank = launch("progress_worker.py", tmp_path, [backend], backend=backend, n=N)[0]
    for rank, (got, expected) in enumerate(zip(per_rank, oracle, strict=True)):
        for scenario in ("float16", "three", "close", "averaged"):
            assert torch.equal(got[scenario]["params"], expected[scenario]["params"]), (backend, rank, scenario)
        assert got["float16"]["ahead"] == STEPS, (backend, rank)
        assert got["outer"]["ahead"] == expected["outer"]["ahead"] > 0, (backend, rank)
        # the outer step's all-reduce sums in the backend's own order: close, not bit for bit
        torch.testing.assert_close(got["outer"]["params"], expected["outer"]["params"], rtol=0, atol=1e-6)
        assert got["three"]["ahead"] >= STEPS, (backend, rank)
        assert got["close"]["ahead_before_close"] == 3, (backend, rank)
        # the all-reduce's order of summation is the backend's own: close, not bit for bit
        torch.testing.assert_close(got["averaged"]["averages"], expected["averaged"]["averages"], rtol=0, atol=1e-6)
        checkpoint = got["checkpoint"]
        assert checkpoint["in_flight"], (backend, rank)
        for key in ("uninterrupted", "continued", "resumed"):
            assert torch.equal(checkpoint[key], expected["checkpoint"][key]), (backend, rank, key)
        assert torch.equal(checkpoint["resumed"], checkpoint["uninterrupted"]), (backend, rank)
