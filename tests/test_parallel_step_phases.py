"""One training step as explicit phases (gossip.wrapper.step_phase), and averaged() without full-model copies
(simulator)."""

from __future__ import annotations

import pytest
import torch
from helpers.parallel_scenarios import batch, flat_parameters, loss_of, make_mlp, wrap

import gossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.wrapper.step_phase import TRANSITIONS, StepPhase, StepPhaseError, StepState

N = 4


def phases_of_one_step(comm) -> list[StepPhase]:
    model = wrap(comm, make_mlp(comm.rank))
    seen = [model.phase]
    loss_of(model, *batch(comm.rank, 0)).backward()
    seen.append(model.phase)
    model.finish_mixing()
    seen.append(model.phase)
    model.next_step()
    seen.append(model.phase)
    model.close()
    seen.append(model.phase)
    return seen


def test_a_step_goes_idle_exchanging_mixed_then_exchanging_for_the_next_step():
    for seen in gossip.simulate(N, phases_of_one_step):
        assert seen == [
            StepPhase.IDLE,  # wrapped: x_0 in place, nothing sent yet
            StepPhase.EXCHANGING,  # the first forward started step 0's exchange
            StepPhase.MIXED,  # finish_mixing wrote the mixed parameters
            StepPhase.EXCHANGING,  # next_step ended step 0 and started step 1's exchange
            StepPhase.CLOSED,
        ]


def next_step_twice(comm) -> str:
    model = wrap(comm, make_mlp(comm.rank))
    loss_of(model, *batch(comm.rank, 0)).backward()
    model.finish_mixing()
    model.next_step()
    try:
        model.next_step()  # step 1's exchange is in flight: its mixing has not been written
    except StepPhaseError as error:
        message = str(error)
    else:
        message = "no error"
    model.close()
    return message


def test_next_step_before_the_mixing_raises_naming_the_rank_the_step_and_the_order_to_use():
    for rank, message in enumerate(gossip.simulate(N, next_step_twice)):
        assert message.startswith(f"rank {rank}: step 1: next_step(): 'advance' is not allowed while the step is ")
        assert "exchanging" in message and "call finish_mixing() before the update and next_step() after it" in message


def test_only_the_table_s_moves_are_legal_and_closed_is_final():
    for event, moves in TRANSITIONS.items():
        for phase in StepPhase:
            state = StepState()
            state.phase = phase
            if phase in moves:
                assert state.move(event, "here") is moves[phase]
            else:
                with pytest.raises(StepPhaseError, match=f"^here: '{event}' is not allowed while the step is"):
                    state.move(event, "here")
                assert state.phase is phase  # a refused move changes nothing
    assert not any(StepPhase.CLOSED in moves for moves in TRANSITIONS.values())
    assert TRANSITIONS["finish"] == {StepPhase.EXCHANGING: StepPhase.MIXED}
    assert TRANSITIONS["advance"] == {StepPhase.MIXED: StepPhase.IDLE}


# -- averaged() with an exchange in flight -------------------------------------------------------------------------
def evaluate_with_exchange_in_flight(comm, batch_norm: bool) -> dict:
    model = wrap(comm, make_mlp(comm.rank, batch_norm=batch_norm))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"phase_before": model.phase, "before": flat_parameters(model)}
    out["buffers_before"] = [b.clone() for b in model.module.buffers() if b.is_floating_point()]
    versions = [bucket.buffer._version for bucket in model.buckets]
    addresses = [p.data_ptr() for p in model.parameters()]
    out["distances"] = [model.consensus_distance(), model.estimate_consensus_distance()]
    with model.averaged(buffers=batch_norm) as net:
        out["distances_inside"] = [model.consensus_distance(), model.estimate_consensus_distance()]
        out["inside"] = flat_parameters(net)
        out["buffers_inside"] = [b.clone() for b in net.buffers() if b.is_floating_point()]
        out["phase_inside"] = model.phase
    out["after"] = flat_parameters(model)
    out["buffers_after"] = [b.clone() for b in model.module.buffers() if b.is_floating_point()]
    out["phase_after"] = model.phase
    out["buckets_written"] = [bucket.buffer._version for bucket in model.buckets] != versions
    out["addresses_kept"] = [p.data_ptr() for p in model.parameters()] == addresses
    model.close()
    return out


@pytest.mark.parametrize("batch_norm", [False, True])
def test_averaged_reads_the_average_without_touching_the_buckets_or_the_exchange_in_flight(batch_norm):
    results = gossip.simulate(N, evaluate_with_exchange_in_flight, batch_norm)
    mean = torch.stack([r["before"] for r in results]).mean(0)
    buffer_means = [torch.stack(group).mean(0) for group in zip(*(r["buffers_before"] for r in results), strict=True)]
    if batch_norm:  # the running statistics are local: the average is not one rank's own
        assert not torch.equal(results[0]["buffers_before"][0], results[1]["buffers_before"][0])
    for r in results:
        assert r["phase_before"] is r["phase_inside"] is r["phase_after"] is StepPhase.EXCHANGING
        assert torch.allclose(r["inside"], mean, atol=1e-6)
        assert torch.equal(r["inside"], results[0]["inside"])  # every rank evaluates the same model
        assert len(r["buffers_inside"]) == (2 if batch_norm else 0)  # BatchNorm: running mean and variance
        for inside, expected in zip(r["buffers_inside"], buffer_means, strict=True):
            assert torch.allclose(inside, expected, atol=1e-6)
        assert torch.equal(r["after"], r["before"])
        for after, before in zip(r["buffers_after"], r["buffers_before"], strict=True):
            assert torch.equal(after, before)
        assert not r["buckets_written"], "averaged() wrote into the buckets (a copy in and out of x_t)"
        assert r["addresses_kept"]
        assert r["distances"][0] > 0 and r["distances_inside"] == r["distances"]  # of the replicas, not the average


def trajectory(comm, algorithm_factory, evaluate: bool) -> torch.Tensor:
    model = wrap(comm, make_mlp(comm.rank), algorithm_factory())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        if evaluate and step in (1, 3):
            with model.averaged():
                pass
        loss_of(model, *batch(comm.rank, step)).backward()
        if evaluate and step == 2:  # between backward and the update, too
            with model.averaged():
                pass
        optimizer.step()
        optimizer.zero_grad()
    result = flat_parameters(model)
    model.close()
    return result


@pytest.mark.parametrize(
    "algorithm_factory",
    [
        pytest.param(lambda: PowerGossip(rank=1, num_iterations=2, min_compression=1), id="powergossip-2-iterations"),
    ],
)
def test_averaged_between_the_rounds_of_a_multi_round_exchange_leaves_training_bit_identical(algorithm_factory):
    plain = gossip.simulate(N, trajectory, algorithm_factory, False)
    evaluated = gossip.simulate(N, trajectory, algorithm_factory, True)
    for a, b in zip(plain, evaluated, strict=True):
        assert torch.equal(a, b)
