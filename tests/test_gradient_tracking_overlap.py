"""Overlapped gradient tracking (``tracking_overlap=True``, DIGing's combine-then-adapt form): each step's tracker
is y_i^t = sum_j W_ij(t) y_j^{t-1} + g_i^t - g_i^{t-1}, the trackers' sum is the gradients' sum after every step
(exact and PowerGossip trackers), the exchange is in flight during forward and backward, resume is bit-identical,
and tracking_overlap without tracking is refused. Gloo and MPI against the simulator:
test_gradient_tracking_powergossip.py."""

from __future__ import annotations

import pytest
import torch
from helpers.parallel_scenarios import batch, checkpoint_resume, loss_of, make_mlp, wrap
from helpers.tracking_scenarios import EPS, STEPS, assert_trackers_sum_to_the_gradients, tracked_steps

import gossip
import topologies
from gossip.errors import InvalidArgumentError

N = 4


def mixing_matrix(step: int) -> torch.Tensor:
    """W(step) of the wrapper's schedule (parallel_scenarios.wrap: one_peer_hypercube), from its peer views."""
    schedule, w = topologies.one_peer_hypercube(N), torch.zeros(N, N, dtype=torch.float64)
    for rank in range(N):
        view = schedule.peers(rank, step)
        w[rank, rank] = view.self_weight
        for peer, weight in view.in_peers:
            w[rank, peer] = weight
    return w


def test_each_tracker_is_the_mixed_previous_trackers_plus_this_ranks_gradient_change():
    per_rank = gossip.simulate(N, tracked_steps, "exact", True, overlap=True)
    previous_y = torch.zeros(N, per_rank[0][0]["y"].numel(), dtype=torch.float64)
    previous_g = torch.zeros_like(previous_y)
    for step in range(STEPS):
        y = torch.stack([rows[step]["y"] for rows in per_rank]).double()
        g = torch.stack([rows[step]["g"] for rows in per_rank]).double()
        expected = mixing_matrix(step) @ previous_y + g - previous_g
        scale = max(y.abs().max().item(), 1.0)
        torch.testing.assert_close(y, expected, rtol=0, atol=8 * EPS * scale, msg=f"step {step}")
        if step == 0:  # y^0 = g^0: the first exchange mixes zeros
            assert torch.equal(y, g)
        for rank, rows in enumerate(per_rank):
            assert torch.equal(rows[step]["grad"], rows[step]["y"]), f"step {step} rank {rank}"
        previous_y, previous_g = y, g


@pytest.mark.parametrize(("algorithm", "tracking"), [("exact", True), ("powergossip", None)])
def test_the_trackers_sum_is_the_gradients_sum_after_every_step(algorithm, tracking):
    """Exact trackers and PowerGossip trackers (rank 1), overlapped."""
    per_rank = gossip.simulate(N, tracked_steps, algorithm, tracking, overlap=True)
    assert_trackers_sum_to_the_gradients(per_rank, optimizer_sees_trackers=False)
    blocking = gossip.simulate(N, tracked_steps, algorithm, tracking)
    assert not torch.equal(per_rank[0][-1]["y"], blocking[0][-1]["y"])  # another form, not the same numbers


def in_flight_during_the_step(comm) -> list[bool]:
    model = wrap(comm, make_mlp(comm.rank), gradient_tracking=True, tracking_overlap=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(3):
        loss = loss_of(model, *batch(comm.rank, step))  # the first forward starts x_t's and y^{t-1}'s exchanges
        loss.backward()
        seen.append(model.tracker._pending is not None)
        optimizer.step()
        seen.append(model.tracker._pending is not None)  # the next step's exchange, posted after the update
        optimizer.zero_grad()
    model.close()
    seen.append(model.tracker._pending is not None)  # close() completed it
    return seen


def test_the_trackers_exchange_is_in_flight_during_forward_and_backward_and_close_completes_it():
    for seen in gossip.simulate(N, in_flight_during_the_step, timeout=20.0):
        assert seen == [True] * 6 + [False]


@pytest.mark.parametrize("tracking", [True, "powergossip"], ids=["exact", "powergossip"])
def test_resume_with_overlapped_trackers_is_bit_identical(tmp_path, tracking):
    kwargs = {"gradient_tracking": tracking, "tracking_overlap": True}
    for rank, result in enumerate(gossip.simulate(N, checkpoint_resume, tmp_path, gossip.ExactGossip, False, **kwargs)):
        assert result["resumed_at"] == 3
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def _overlap_without_tracking(comm) -> str:
    try:
        wrap(comm, make_mlp(comm.rank), tracking_overlap=True)
    except InvalidArgumentError as error:
        return str(error)
    return "accepted"


def test_tracking_overlap_without_tracking_is_refused_on_every_rank():
    for rank, message in enumerate(gossip.simulate(2, _overlap_without_tracking)):
        assert message.startswith(f"rank {rank}: tracking_overlap=True overlaps the trackers' exchange"), message
