"""Gradient tracking (``DecentralizedDataParallel(..., gradient_tracking=True)``, gossip.wrapper.tracking) on the
simulator: the trackers' sum equals the gradients' sum at every step, the complete graph gives every rank the
exact mean gradient (replicas stay bit-identical), a schedule that is not doubly stochastic is refused, and
resume is bit-identical. The same training and resume scenarios run on Gloo and MPI in
test_parallel_multiprocess.py, where they must equal the simulator bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.parallel_scenarios import batch, checkpoint_resume, loss_of, make_mlp, train, wrap
from helpers.tracking_scenarios import EPS, assert_trackers_sum_to_the_gradients, comparison_bytes, tracked_steps

import gossip
import topologies
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.errors import CheckpointMismatchError, InvalidArgumentError
from gossip.wrapper.parallel import DecentralizedDataParallel

N = 4
STEPS = 10


def trackers_per_step(comm, schedule: str, algorithm: str = "exact") -> list[dict]:
    """SGD with exact gradient tracking on ``schedule``, STEPS steps (tracking_scenarios.tracked_steps' rows)."""
    return tracked_steps(comm, algorithm, True, steps=STEPS, schedule=schedule)


@pytest.mark.parametrize("algorithm", ["exact", "powergossip"])
def test_the_trackers_sum_is_the_gradients_sum_at_every_step(algorithm):
    per_rank = gossip.simulate(N, trackers_per_step, "ring", algorithm)
    assert_trackers_sum_to_the_gradients(per_rank)
    # the trackers differ from the local gradients (the ranks' data differ), so tracking did something
    assert not torch.equal(per_rank[0][-1]["y"], per_rank[0][-1]["g"])


def test_on_the_complete_graph_every_rank_steps_on_the_exact_mean_gradient_and_the_replicas_stay_identical():
    per_rank = gossip.simulate(N, trackers_per_step, "complete")
    for step in range(STEPS):
        reference = per_rank[0][step]
        mean = torch.stack([rows[step]["g"] for rows in per_rank]).double().mean(0)
        for rank, rows in enumerate(per_rank):
            # the trackers are summed in rank order on every rank: the same bits everywhere
            assert torch.equal(rows[step]["y"], reference["y"]), f"step {step} rank {rank}"
            assert torch.equal(rows[step]["x"], reference["x"]), f"step {step} rank {rank}"
        # y = sum_j (1/N) g_j in float32 (previous tracker terms cancel up to rounding): a few eps of the scale
        scale = mean.abs().max().item()
        tolerance = (step + 1) * (N + 2) * EPS * max(scale, reference["y"].abs().max().item())
        gap = (reference["y"].double() - mean).abs().max().item()
        assert gap <= tolerance, f"step {step}: |y - mean g| = {gap:.3g} > {tolerance:.3g}"


def test_the_tracker_exchange_costs_one_more_exact_exchange_per_step():
    with_tracking = gossip.simulate(N, trackers_per_step, "ring")
    model_bytes = with_tracking[0][0]["x"].numel() * 4
    for rank, rows in enumerate(with_tracking):
        # ring: 2 out-peers; parameters and trackers each go whole to each of them (and at the first steps the
        # optimizers' comparison)
        comparison = comparison_bytes("ring", N, rank, STEPS)
        assert [row["bytes_sent"] for row in rows] == [2 * 2 * model_bytes + c for c in comparison]


def _row_stochastic_only(comm) -> str:
    matrix = np.array([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.0, 0.5]])
    schedule = topologies.from_matrix(matrix, "lopsided")
    try:
        DecentralizedDataParallel(make_mlp(comm.rank), comm, schedule, ExactGossip(), gradient_tracking=True)
    except InvalidArgumentError as error:
        return str(error)
    return "accepted"


def test_a_schedule_that_is_not_doubly_stochastic_is_refused_on_every_rank():
    for rank, message in enumerate(gossip.simulate(3, _row_stochastic_only)):
        assert message.startswith(f"rank {rank}: gradient_tracking=True needs a doubly stochastic schedule"), message
        assert "'lopsided'" in message and "column" in message


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
def test_resume_with_trackers_is_bit_identical(tmp_path, algorithm):
    results = gossip.simulate(N, checkpoint_resume, tmp_path, algorithm, False, gradient_tracking=True)
    for rank, result in enumerate(results):
        assert result["resumed_at"] == 3
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def _tracking_state_into_a_plain_run(comm) -> str:
    tracked = wrap(comm, make_mlp(comm.rank), gradient_tracking=True)
    optimizer = torch.optim.SGD(tracked.parameters(), lr=0.05)
    loss_of(tracked, *batch(comm.rank, 0)).backward()
    optimizer.step()
    state = tracked.training_state()
    tracked.close()
    plain = wrap(comm, make_mlp(comm.rank))
    try:
        plain.load_training_state(state)
    except CheckpointMismatchError as error:
        return str(error)
    finally:
        plain.close()
    return "accepted"


def test_a_state_saved_with_tracking_is_refused_by_a_run_without():
    for rank, message in enumerate(gossip.simulate(N, _tracking_state_into_a_plain_run)):
        assert message.startswith(f"rank {rank}: the state was saved with gradient tracking"), message


def test_tracking_trains_and_differs_from_plain_gossip():
    tracked = gossip.simulate(N, train, 8, gradient_tracking=True)
    plain = gossip.simulate(N, train, 8)
    first = sum(r["losses"][0] for r in tracked) / N
    last = sum(r["losses"][-1] for r in tracked) / N
    assert last < 0.8 * first
    assert not torch.equal(tracked[0]["params"], plain[0]["params"])
