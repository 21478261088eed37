"""NaN or Inf received from a peer: raise naming this rank, the peer and the step, or drop it and stay stochastic.

Also: a communication error inside the training loop says at which training step it happened.
"""

from __future__ import annotations

import math
import re
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
from gossip.wrapper.parallel import DecentralizedDataParallel

N = 4
BAD = 1  # the rank whose parameters go non-finite; on ring(4) its peers are 0 and 2


def nonfinite_count(buckets) -> int:
    """How many NaN or Inf the buckets hold."""
    return sum(int((~torch.isfinite(bucket.buffer)).sum()) for bucket in buckets)


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


def error_of(comm, *args) -> str | None:
    """:func:`steps_with_a_bad_peer`'s NonFiniteError on this rank, if any (the bad step is the last, so every rank
    completes its exchanges before raising)."""
    try:
        steps_with_a_bad_peer(comm, *args)
    except NonFiniteError as error:
        return str(error)
    return None


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_from_a_peer_raises_naming_rank_peer_and_step(algorithm, value):
    """Ranks 0 and 2 receive from rank 1 and name it; PowerGossip's rank 1 finds its own products non-finite in R
    (the difference of the two ends' products) and names itself."""
    errors = gossip.simulate(N, error_of, algorithm, 2, value)
    for rank in (0, 2):
        assert errors[rank].startswith(f"rank {rank}: step 2: peer 1 sent non-finite values (NaN or Inf)"), errors
    assert errors[3] is None
    if algorithm is PowerGossip:
        assert re.match(r"rank 1: step 2: this rank's own products for peer [02] are not finite", errors[1]), errors
    else:
        assert errors[1] is None  # exact gossip sends its values as they are: its peers check them


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
    with pytest.warns(NonFiniteWarning) as caught:
        gossip.simulate(N, steps_with_a_bad_peer, lambda: algorithm(nonfinite="drop"), 1, float("inf"), 2)
    messages = sorted(str(w.message) for w in caught)
    dropped = [m for m in messages if "dropped the contribution" in m]
    assert [m.split(": dropped")[0] for m in dropped] == ["rank 0: step 1", "rank 2: step 1"], messages
    assert all(
        m.endswith(
            "of peer 1, which sent non-finite values (NaN or Inf); its weight stays with this rank's own parameters"
        )
        for m in dropped
    ), messages
    own = [m for m in messages if m not in dropped]
    if algorithm is PowerGossip:  # rank 1 skips the corrections its own non-finite products would make
        assert [m.split(" for peer")[0] for m in own] == ["rank 1: step 1: this rank's own products"] * 2, messages
        assert all(m.endswith("; the correction of that edge is skipped") for m in own), messages
    else:
        assert own == [], messages


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_powergossip_checks_the_uncompressed_tensors_a_peer_sent(policy):
    """A NaN in one of rank 1's uncompressed tensors (fc.bias) only: its products, and so R, are finite; its peers
    raise or drop naming it, rank 1 itself has nothing to say, and only rank 1 holds a non-finite value after."""

    def run(comm):
        buckets, algorithm = local_model(comm.rank), PowerGossip(nonfinite=policy, min_compression=1)
        algorithm.setup(comm, topologies.ring(comm.size), buckets)
        bucket, entry = next((b, e) for b in buckets for e in b.entries if e.name == "fc.bias")
        if comm.rank == BAD:
            bucket.view(entry)[3] = float("nan")
        try:
            algorithm.step(0)
        except NonFiniteError as error:
            return str(error)
        return nonfinite_count(buckets)

    if policy == "raise":
        results = gossip.simulate(N, run)
        for rank in (0, 2):
            assert results[rank].startswith(f"rank {rank}: step 0: peer 1 sent non-finite values"), results
        assert results[1] == 1 and results[3] == 0, results
    else:
        with pytest.warns(NonFiniteWarning) as caught:
            assert gossip.simulate(N, run) == [0, 1, 0, 0]
        assert sorted(str(w.message).split(", which")[0] for w in caught) == [
            "rank 0: step 0: dropped the contribution of peer 1",
            "rank 2: step 0: dropped the contribution of peer 1",
        ]


def test_under_drop_a_rank_whose_own_products_are_not_finite_leaves_its_parameters_as_they_were():
    """PowerGossip, nonfinite="drop": one weight of rank 1 is NaN, so its products and R on both its edges are;
    it skips both corrections (which would spread the NaN over the matrix), so that weight stays its only
    non-finite value, and its peers drop its contribution and stay finite."""

    def run(comm):
        buckets, algorithm = local_model(comm.rank), PowerGossip(nonfinite="drop", min_compression=1)
        algorithm.setup(comm, topologies.ring(comm.size), buckets)
        if comm.rank == BAD:
            corrupt(buckets, float("nan"))  # conv.weight, a compressed matrix
        algorithm.step(0)
        return nonfinite_count(buckets)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        assert gossip.simulate(N, run) == [0, 1, 0, 0]


def test_finite_values_whose_sums_overflow_are_not_reported_as_nonfinite():
    """PowerGossip reads R's column sums and the uncompressed tensors' sum to find NaN and Inf; values near
    float32's largest (of one sign, scaled by 2e37 to 8e37 here) make some of those sums overflow although every
    value is finite, and the exact check behind them must say so: no error, no dropped peer, every replica finite."""

    def run(comm):
        buckets, algorithm = local_model(comm.rank), PowerGossip(min_compression=1)
        for bucket in buckets:
            bucket.buffer.abs_().mul_(2e37 * (comm.rank + 1))
        algorithm.setup(comm, topologies.ring(comm.size), buckets)
        algorithm.step(0)
        sums = [
            value
            for edge in algorithm.edges.values()
            for plan in edge.plans.values()
            for value in plan.replaced.sums.tolist()
        ]
        return sum(not math.isfinite(value) for value in sums), nonfinite_count(buckets)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = gossip.simulate(N, run)
    assert not [w for w in caught if issubclass(w.category, NonFiniteWarning)]
    assert all(overflowed > 0 for overflowed, _ in results), results  # the case is exercised on every rank
    assert [count for _, count in results] == [0] * N


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
    # rank 3's peers name the training step in which they learn of the failure: step 1 if it comes while they still
    # post step 2's exchange (at the end of step 1's optimizer.step()), step 2, or step 3 if rank 3's step-2
    # message had been sent before it crashed.
    for rank in (0, 2):
        step, text = messages[rank].split(": ", 1)
        assert step in ("step 1", "step 2", "step 3"), messages[rank]
        assert text.startswith(f"rank {rank}: peer rank 3 failed"), messages[rank]


def deferred(algorithm_class: type) -> type:
    """``algorithm_class`` with the check deferred as on CUDA parameters (flags read at the next step)."""

    class Deferred(algorithm_class):
        def setup(self, *args) -> None:
            super().setup(*args)
            self.deferred_nonfinite_check = True

    return Deferred


def bad_last_step_then_check(comm, algorithm_class: type, value: float) -> list:
    """Rank BAD sends ``value`` at step 1 of 2; the steps complete, the check raises only when read."""
    buckets, algorithm = local_model(comm.rank), deferred(algorithm_class)()
    algorithm.setup(comm, topologies.ring(comm.size), buckets)
    for step in range(2):
        saved = buckets[0].buffer.clone()
        if comm.rank == BAD and step == 1:
            corrupt(buckets, value)
        algorithm.step(step)  # no error here: nothing is read from the device on the hot path
        if comm.rank == BAD:
            buckets[0].buffer.copy_(saved)
    messages = []
    for _ in range(2):  # the second read finds nothing pending
        try:
            algorithm.check_deferred()
            messages.append(None)
        except NonFiniteError as error:
            messages.append(str(error))
    return messages


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
def test_a_deferred_check_names_the_step_the_values_arrived_in_when_read(algorithm):
    results = gossip.simulate(N, bad_last_step_then_check, algorithm, float("nan"))
    for rank in (0, 2):
        first, second = results[rank]
        assert first.startswith(
            f"rank {rank}: step 1: peer 1 sent non-finite values (NaN or Inf) to mix in; its replica has diverged "
            "(found one step later"
        ), first
        assert second is None
    assert results[1] == results[3] == [None, None]


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
def test_a_deferred_check_raises_at_the_next_step(algorithm):
    with pytest.raises(NonFiniteError, match=r"^rank [02]: step 1: peer 1 sent non-finite .*found one step later"):
        gossip.simulate(N, steps_with_a_bad_peer, deferred(algorithm), 1, float("inf"), 3)


def test_close_raises_for_nonfinite_values_of_the_last_step_under_a_deferred_check():
    errors: dict[int, str] = {}

    def run(comm) -> None:
        model = DecentralizedDataParallel(make_mlp(comm.rank), comm, topologies.ring(comm.size), ExactGossip())
        model.algorithm.deferred_nonfinite_check = True
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            if comm.rank == BAD and step == 1:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        try:
            model.close()
        except NonFiniteError as error:
            errors[comm.rank] = str(error)

    gossip.simulate(N, run)
    assert sorted(errors) == [0, 2]
    # rank 1's NaN is first sent with x_2, whose exchange starts after step 1's update and completes in close()
    assert all(errors[r].startswith(f"rank {r}: step 2: peer 1 sent non-finite") for r in errors), errors


def test_a_deferred_check_inside_periodic_average_names_the_training_step():
    """every=3: training steps 0, 1, 3, 4 gossip (inner steps 0, 1, 2, 3), step 2 averages. NaN sent at training
    step 3 (inner step 2) is found at step 4's start, named in both numberings."""

    def make() -> gossip.PeriodicAverage:
        return gossip.PeriodicAverage(deferred(ExactGossip)(), every=3)

    with pytest.raises(NonFiniteError, match=r"^rank [02]: step 2: peer 1 sent .* \[exact step 2 is step 3 of Per"):
        gossip.simulate(N, steps_with_a_bad_peer, make, 3, float("nan"), 5)


def test_a_float16_message_that_overflows_is_named_with_the_remedy():
    """A finite parameter of 1e8 makes products beyond float16's 65504: the peers receive Inf and name the sender,
    the sender finds its own products non-finite and names itself, each error with the overflow and bfloat16 as the
    remedy. (Each rank's error is caught where it is raised, at the last step, after every exchange completed: a
    rank that raised first could otherwise fail its peers' waits before they read what they received.)"""
    make = lambda: PowerGossip(rank=1, min_compression=1, message_dtype=torch.float16)  # noqa: E731
    errors = gossip.simulate(N, error_of, make, 2, 1e8)
    remedy = r".*overflowed PowerGossip's float16 messages .*message_dtype=torch.bfloat16"
    for rank in (0, 2):
        assert re.match(rf"rank {rank}: step 2: peer 1 sent non-finite values{remedy}", errors[rank]), errors
    assert re.match(rf"rank 1: step 2: this rank's own products for peer [02] are not finite{remedy}", errors[1])
    assert errors[3] is None
