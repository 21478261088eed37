"""NaN or Inf received from a peer: raise naming this rank, the peer and the step, or drop it and stay stochastic.

Also: a communication error inside the training loop says at which training step it happened.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.algorithm_scenarios import local_model
from helpers.parallel_scenarios import batch, loss_of, make_mlp
from hypothesis import given, settings
from hypothesis import strategies as st

import gossip
import topologies
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.errors import NonFiniteError, NonFiniteWarning
from gossip.parallel import DecentralizedDataParallel

N = 4
BAD = 1  # the rank whose parameters go non-finite; on ring(4) its peers are 0 and 2


def corrupt(buckets, value: float, index: int = 0) -> None:
    buckets[0].buffer[index] = value


def steps_with_a_bad_peer(comm, make_algorithm, bad_step: int, value: float, steps: int = 3) -> list[torch.Tensor]:
    buckets, algorithm = local_model(comm.rank), make_algorithm()
    algorithm.setup(comm, topologies.ring(comm.size), buckets)
    for step in range(steps):
        saved = buckets[0].buffer.clone()
        if comm.rank == BAD and step == bad_step:
            corrupt(buckets, value)
        algorithm.step(step)
        if comm.rank == BAD and step == bad_step:
            buckets[0].buffer.copy_(saved)  # only what it sent at bad_step was non-finite
    return [bucket.buffer.clone() for bucket in buckets]


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_from_a_peer_raises_naming_rank_peer_and_step(algorithm, value):
    # ranks 0 and 2 both receive from rank 1; simulate re-raises whichever raised first
    with pytest.raises(NonFiniteError, match=r"^rank [02]: step 2: peer 1 sent non-finite values \(NaN or Inf\)"):
        gossip.simulate(N, steps_with_a_bad_peer, algorithm, 2, value)


def constants(comm, algorithm, value: float, bad_index: int) -> list[torch.Tensor]:
    buckets = local_model(comm.rank)
    for bucket in buckets:
        bucket.buffer.fill_(value)
    if comm.rank == BAD:
        corrupt(buckets, float("nan"), bad_index)
    algorithm.setup(comm, topologies.ring(comm.size), buckets)
    algorithm.step(0)
    return [bucket.buffer.clone() for bucket in buckets]


@settings(max_examples=10, deadline=None)
@given(value=st.floats(-100, 100), bad_index=st.integers(0, 200))
def test_dropping_a_nonfinite_peer_keeps_the_row_stochastic(value, bad_index):
    """A constant stays constant on the bad rank's peers: its weight went back to the self weight."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        results = gossip.simulate(N, lambda comm: constants(comm, ExactGossip(nonfinite="drop"), value, bad_index))
    for rank in (0, 2):
        for buffer in results[rank]:
            torch.testing.assert_close(buffer, torch.full_like(buffer, value), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
def test_dropping_warns_naming_peer_and_step(algorithm):
    with pytest.warns(NonFiniteWarning, match=r"rank [02]: step 1: dropped the contribution of peer 1") as caught:
        gossip.simulate(N, steps_with_a_bad_peer, lambda: algorithm(nonfinite="drop"), 1, float("inf"), 2)
    assert {str(w.message).split(":")[0] for w in caught} == {"rank 0", "rank 2"}


def test_powergossip_keeps_exchanging_after_a_dropped_step():
    """The parity advances on both ends (no shape mismatch on non-square matrices) and the peers stay finite."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        drop = lambda: PowerGossip(nonfinite="drop", min_compression=1)  # noqa: E731
        results = gossip.simulate(N, steps_with_a_bad_peer, drop, 0, float("inf"))
    for rank in (0, 2, 3):
        assert all(torch.isfinite(buffer).all() for buffer in results[rank]), f"rank {rank}"


def test_communication_error_in_the_loop_names_the_training_step():
    messages: dict[int, str] = {}

    def run(comm) -> None:
        model = DecentralizedDataParallel(make_mlp(comm.rank), comm, topologies.ring(comm.size), ExactGossip())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            for step in range(5):
                if comm.rank == 3 and step == 2:
                    raise RuntimeError("rank 3 crashed")
                loss_of(model, *batch(comm.rank, step)).backward()
                optimizer.step()
                optimizer.zero_grad()
        except gossip.GossipError as error:
            messages[comm.rank] = str(error)

    with pytest.raises(RuntimeError, match="rank 3 crashed"):
        gossip.simulate(N, run, timeout=10.0)
    for rank in (0, 2):  # rank 3's peers; its step-2 message may have been sent, so they may fail at step 3
        step, text = messages[rank].split(": ", 1)
        assert step in ("step 2", "step 3") and text.startswith(f"rank {rank}: peer rank 3 failed"), messages[rank]
