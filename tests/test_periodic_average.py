"""PeriodicAverage (gossip with periodic global averaging, Chen et al. ICML 2021) on the in-process simulator.

Pinned: the sum over ranks is preserved; after an averaging step every replica holds the same bits (consensus
distance 0); between averaging steps the trajectory is the inner algorithm's, bit for bit; PowerGossip's edge
factors stay identical on both ends; resume mid-period is bit-identical; traffic equals the communicator's
counters plus the all-reduce's bytes; a bad ``every``, a different ``every`` on one rank and a NaN replica are
refused with errors naming what and where. Gloo and MPI run the same scenarios in test_algorithms_backends.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.algorithm_scenarios import local_model, make_algorithm, make_schedule, run_steps
from helpers.parallel_scenarios import checkpoint_resume, flat_parameters, make_mlp, train
from torch import nn

import gossip
import topologies
from gossip.algorithms.allreduce import COLLECTIVE
from gossip.algorithms.buckets import pack
from gossip.errors import NonFiniteWarning
from gossip.wrapper.consensus import exact_consensus_sq
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.replicas import ReplicaMismatchError

INNER = ["exact", "powergossip-r1", "powergossip-r2-2it"]
EVERY = 3
STEPS = 7  # averaging steps 2 and 5; step 6 is a gossip step after an average


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("inner", INNER)
def test_sum_over_ranks_is_preserved_after_every_step(n, inner):
    sums = gossip.simulate(n, run_steps, f"pga{EVERY}-{inner}", "hypercube", steps=STEPS)[0]["sums"]
    for step, total in enumerate(sums[1:]):
        relative = (total - sums[0]).norm() / sums[0].norm()
        assert relative < 1e-6, f"step {step}: sum drifted by {relative:.2e}"


def _trajectory_and_twin(comm, inner_name: str, schedule_name: str) -> dict:
    """Run PeriodicAverage(inner) with a rank- and step-specific local update before every step (as training
    makes the replicas differ again after an average) and, on every gossip step, the inner algorithm alone on a
    copy of the same parameters (a twin object with the wrapper's inner state); record both and the consensus."""
    buckets, twin_buckets = local_model(comm.rank), local_model(comm.rank)
    schedule = make_schedule(schedule_name, comm.size)
    wrapper = gossip.PeriodicAverage(make_algorithm(inner_name), every=EVERY)
    wrapper.setup(comm, schedule, buckets)
    twin = make_algorithm(inner_name)
    twin.setup(comm, schedule, twin_buckets)
    rows = []
    for step in range(STEPS):
        update = torch.Generator().manual_seed(1000 * step + comm.rank)
        for mine, theirs in zip(buckets, twin_buckets, strict=True):
            mine.buffer.add_(torch.randn(mine.buffer.shape, generator=update), alpha=0.1)
            theirs.buffer.copy_(mine.buffer)
        twin.load_state_dict(copy.deepcopy(wrapper.inner.state_dict()))
        wrapper.step(step)
        if not wrapper.period.ends(step):
            twin.step(wrapper.period.between(step))
        rows.append(
            {
                "averaged": wrapper.period.ends(step),
                "buffers": [b.buffer.clone() for b in buckets],
                "twin": [b.buffer.clone() for b in twin_buckets],
                "consensus_sq": exact_consensus_sq([b.buffer for b in buckets], comm),
            }
        )
    return {"rows": rows, "edges": getattr(wrapper.inner, "edges", {})}


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("inner", INNER)
def test_averaging_steps_make_replicas_identical_and_others_follow_the_inner_algorithm(n, inner):
    results = gossip.simulate(n, _trajectory_and_twin, inner, "ring")  # the ring never reaches consensus alone
    assert [row["averaged"] for row in results[0]["rows"]] == [(s + 1) % EVERY == 0 for s in range(STEPS)]
    for step in range(STEPS):
        rows = [result["rows"][step] for result in results]
        if rows[0]["averaged"]:
            for rank, row in enumerate(rows[1:], start=1):
                assert all(torch.equal(a, b) for a, b in zip(row["buffers"], rows[0]["buffers"], strict=True)), (
                    f"step {step}: rank {rank}'s replica differs from rank 0's after the global average"
                )
            assert rows[0]["consensus_sq"] == 0.0
        else:
            assert rows[0]["consensus_sq"] > 0.0
            for rank, row in enumerate(rows):
                assert all(torch.equal(a, b) for a, b in zip(row["buffers"], row["twin"], strict=True)), (
                    f"step {step}: rank {rank} differs from {inner} alone on the same parameters and state"
                )


@pytest.mark.parametrize("n", [4, 8])
def test_powergossip_factors_stay_bit_identical_on_both_ends_of_every_edge(n):
    results = gossip.simulate(n, _trajectory_and_twin, "powergossip-r2-2it", "hypercube")
    edges_seen = 0
    for rank, result in enumerate(results):
        for (lo, hi), edge in result["edges"].items():
            other = results[hi if rank == lo else lo]["edges"][(lo, hi)]
            assert edge.iteration == other.iteration, f"edge {(lo, hi)}: parity counters differ"
            assert all(torch.equal(a, b) for a, b in zip(edge.p + edge.q, other.p + other.q, strict=True)), (
                f"edge {(lo, hi)}: factors differ between rank {lo} and rank {hi}"
            )
            edges_seen += 1
    assert edges_seen == n * (n.bit_length() - 1)  # every hypercube edge used, seen from both ends


def test_the_inner_algorithm_counts_only_its_own_steps_so_every_phase_of_the_schedule_is_used():
    """every=2 on the 4-rank one-peer hypercube (period 2): numbered by the training step, the inner algorithm
    would only ever run even steps, i.e. the edges to partner rank ^ 1; counted by its own steps it alternates."""

    def run(comm) -> dict:
        algorithm = gossip.PeriodicAverage(gossip.PowerGossip(rank=1, min_compression=1), every=2)
        algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), local_model(comm.rank))
        for step in range(4):
            algorithm.step(step)
        return {key: edge.iteration for key, edge in algorithm.inner.edges.items()}

    every_third = gossip.PeriodicAverage(gossip.ExactGossip(), every=3)
    assert [every_third.period.between(t) for t in (0, 1, 3, 4, 6)] == [0, 1, 2, 3, 4]
    assert gossip.simulate(4, run)[0] == {(0, 1): 1, (0, 2): 1}


@pytest.mark.parametrize("inner", INNER)
def test_traffic_equals_the_communicators_counters_plus_the_all_reduce_bytes(inner):
    n = 4
    results = gossip.simulate(n, run_steps, f"pga{EVERY}-{inner}", "hypercube", steps=STEPS)
    model_bytes = sum(b.nbytes for b in local_model(0))
    averaging_steps = sum((s + 1) % EVERY == 0 for s in range(STEPS))
    for rank, result in enumerate(results):
        sent, received = dict(result["sent"]), dict(result["received"])
        expected = averaging_steps * round(2 * (n - 1) / n * model_bytes)
        assert sent.pop(COLLECTIVE) == received.pop(COLLECTIVE) == expected, f"rank {rank}"
        assert sent == result["comm_sent"] and received == result["comm_received"], f"rank {rank}"


def test_every_one_is_all_reduce_bit_for_bit_bytes_included():
    wrapped = gossip.simulate(4, run_steps, "pga1-powergossip-r1", "hypercube", steps=3)
    plain = gossip.simulate(4, run_steps, "allreduce", "hypercube", steps=3)
    for rank, (w, p) in enumerate(zip(wrapped, plain, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(w["buffers"], p["buffers"], strict=True)), f"rank {rank}"
        assert (w["sent"], w["received"]) == (p["sent"], p["received"])


@pytest.mark.parametrize("every", [0, -2, 1.5, True, "4"])
def test_every_below_one_or_not_an_integer_is_refused(every):
    with pytest.raises(ValueError, match=rf"PeriodicAverage: every must be an integer >= 1 .* got {every!r}"):
        gossip.PeriodicAverage(gossip.ExactGossip(), every=every)


def test_inner_that_is_not_an_algorithm_is_refused():
    with pytest.raises(TypeError, match=r"PeriodicAverage: inner must be a gossip\.Algorithm, got int"):
        gossip.PeriodicAverage(4, every=4)


def construction_error(comm: gossip.Communicator, algorithm: gossip.Algorithm) -> str:
    """The ReplicaMismatchError message of wrapping a small model with ``algorithm`` ("no error" if none)."""
    try:
        DecentralizedDataParallel(nn.Linear(6, 4), comm, topologies.one_peer_hypercube(comm.size), algorithm)
    except ReplicaMismatchError as error:
        return str(error)
    return "no error"


def test_a_different_every_on_one_rank_is_refused_naming_the_rank():
    def build(comm) -> str:
        inner = gossip.PowerGossip(rank=1)
        return construction_error(comm, gossip.PeriodicAverage(inner, every=8 if comm.rank == 2 else 16))

    messages = gossip.simulate(4, build)
    assert all(m.startswith("rank 2 uses algorithm {'name': 'periodic-average', 'every': 8") for m in messages)
    assert all("but rank 0 uses {'name': 'periodic-average', 'every': 16" in m for m in messages)


def test_a_different_inner_setting_on_one_rank_is_refused_naming_the_rank():
    def build(comm) -> str:
        return construction_error(
            comm, gossip.PeriodicAverage(gossip.PowerGossip(rank=2 if comm.rank == 1 else 1), every=4)
        )

    messages = gossip.simulate(4, build)
    assert all(m.startswith("rank 1 uses algorithm") and "'rank': 2" in m for m in messages)


def test_the_inner_algorithm_still_refuses_a_schedule_it_cannot_run():
    def build(comm) -> str:
        algorithm = gossip.PeriodicAverage(gossip.PowerGossip(rank=1), every=4)
        try:
            algorithm.setup(comm, topologies.by_name("one_peer_exponential", comm.size), local_model(comm.rank))
        except topologies.ScheduleError as error:
            return str(error)
        return "no error"

    assert all("symmetric" in m for m in gossip.simulate(4, build))


def test_the_schedule_is_validated_once_for_the_wrapper_and_its_inner_algorithm(monkeypatch):
    schedule = topologies.ring(2)  # built (and validated) before the count starts
    calls: list[bool] = []
    validate = topologies.Schedule.validate

    def counted(self, **kwargs) -> None:
        calls.append(kwargs.get("symmetric", False))
        validate(self, **kwargs)

    monkeypatch.setattr(topologies.Schedule, "validate", counted)

    def bind(comm) -> None:
        algorithm = gossip.PeriodicAverage(gossip.PowerGossip(rank=1), every=4)
        algorithm.setup(comm, schedule, local_model(comm.rank))

    gossip.simulate(2, bind)
    assert calls == [True, True]  # one per rank, with PowerGossip's need for a symmetric schedule


def test_resume_mid_period_through_a_checkpoint_is_bit_identical(tmp_path):
    """6 steps vs 3 + save + load + 3 under DecentralizedDataParallel; averaging steps 1, 3, 5, saved after 2."""

    def factory() -> gossip.PeriodicAverage:
        return gossip.PeriodicAverage(gossip.PowerGossip(rank=1), every=2)

    for rank, result in enumerate(gossip.simulate(4, checkpoint_resume, tmp_path, factory)):
        assert result["resumed_at"] == 3
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def test_state_dict_of_another_every_is_refused():
    def run(comm) -> str:
        schedule = topologies.one_peer_hypercube(comm.size)
        saved = gossip.PeriodicAverage(gossip.PowerGossip(rank=1), every=4)
        saved.setup(comm, schedule, local_model(comm.rank))
        other = gossip.PeriodicAverage(gossip.PowerGossip(rank=1), every=8)
        other.setup(comm, schedule, local_model(comm.rank))
        try:
            other.load_state_dict(saved.state_dict())
        except ValueError as error:
            return str(error)
        return "no error"

    messages = gossip.simulate(2, run)
    assert messages[1].startswith("rank 1: PeriodicAverage state was saved with {'every': 4")


def _nan_on_rank_2_before_the_average(comm, nonfinite: str) -> dict:
    buckets = local_model(comm.rank)
    algorithm = gossip.PeriodicAverage(gossip.ExactGossip(nonfinite=nonfinite), every=2)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    algorithm.step(0)
    if comm.rank == 2:
        buckets[0].buffer[3] = float("nan")
    finite_sum = [b.buffer.clone() if comm.rank != 2 else torch.zeros_like(b.buffer) for b in buckets]
    for total in finite_sum:
        comm.all_reduce(total)
    try:
        algorithm.step(1)
    except gossip.NonFiniteError as error:
        return {"error": str(error)}
    return {"buffers": [b.buffer for b in buckets], "finite_mean": [t / 3 for t in finite_sum]}


def test_a_nan_replica_at_an_averaging_step_raises_naming_the_rank_and_step():
    results = gossip.simulate(4, _nan_on_rank_2_before_the_average, "raise")
    for rank, result in enumerate(results):
        assert result["error"].startswith(
            f"rank {rank}: step 1: PeriodicAverage's global average is non-finite: ranks [2] hold NaN or Inf"
        )


def test_a_finite_sum_that_overflows_or_nan_everywhere_is_named_as_such():
    def run(comm, value: float) -> str:
        buckets = pack([("w", torch.full((4, 3), value))])
        algorithm = gossip.PeriodicAverage(gossip.ExactGossip(nonfinite="drop"), every=1)
        algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
        try:
            algorithm.step(0)
        except gossip.NonFiniteError as error:
            return str(error)
        return "no error"

    overflow = gossip.simulate(4, run, 3e38)[3]
    assert overflow == (
        "rank 3: step 0: PeriodicAverage's global average is non-finite: every replica is finite but their sum "
        "overflows; training has diverged (lower the learning rate)"
    )
    assert gossip.simulate(4, run, float("nan"))[1].endswith(
        ": every rank's replica holds NaN or Inf (lower the learning rate)"
    )


def test_with_drop_a_nan_replica_is_left_out_of_the_average_with_a_warning():
    with pytest.warns(NonFiniteWarning) as caught:
        results = gossip.simulate(4, _nan_on_rank_2_before_the_average, "drop")
    assert sorted(str(w.message) for w in caught) == [
        f"rank {rank}: step 1: PeriodicAverage dropped the replicas of ranks [2], which hold non-finite values "
        "(NaN or Inf); every rank takes the mean of the other 3"
        for rank in range(4)
    ]
    for rank, result in enumerate(results):
        assert all(torch.equal(b, e) for b, e in zip(result["buffers"], result["finite_mean"], strict=True)), (
            f"rank {rank} does not hold the mean of the finite replicas"
        )


def test_an_error_of_the_inner_algorithm_names_its_step_and_the_training_step():
    def run(comm) -> str:
        buckets = local_model(comm.rank)
        algorithm = gossip.PeriodicAverage(gossip.ExactGossip(), every=2)
        algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
        algorithm.step(0)
        algorithm.step(1)
        if comm.rank == 2:
            buckets[0].buffer[0] = float("inf")
        try:
            algorithm.step(2)  # the inner algorithm's step 1: rank 0 and rank 2 are partners
        except gossip.NonFiniteError as error:
            return str(error)
        return "no error"

    message = gossip.simulate(4, run)[0]
    assert message.startswith("rank 0: step 1: peer 2 sent non-finite values")
    assert message.endswith("[exact step 1 is step 2 of PeriodicAverage]")


def test_adaptive_powergossip_inside_decides_on_its_own_steps_with_identical_factors():
    """AdaptivePowerGossip(every=2) decides after its own steps 1 and 3 (training steps 1 and 4 with averages at 2
    and 5); the factors stay bit-identical on both ends across the averages and the rank change."""

    def run(comm) -> dict:
        buckets = local_model(comm.rank)
        inner = gossip.AdaptivePowerGossip(ladder=(1, 2), every=2, min_compression=1)
        algorithm = gossip.PeriodicAverage(inner, every=EVERY)
        algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
        for step in range(STEPS):
            update = torch.Generator().manual_seed(1000 * step + comm.rank)
            for bucket in buckets:
                bucket.buffer.add_(torch.randn(bucket.buffer.shape, generator=update), alpha=0.1)
            algorithm.step(step)
        return {"history": [h["step"] for h in inner.history], "rank": inner.matrix_rank, "edges": inner.edges}

    results = gossip.simulate(4, run)
    assert results[0]["history"] == [2, 4]  # after its own steps 1 and 3
    assert len({r["rank"] for r in results}) == 1
    for rank, result in enumerate(results):
        for (lo, hi), edge in result["edges"].items():
            other = results[hi if rank == lo else lo]["edges"][(lo, hi)]
            assert all(torch.equal(a, b) for a, b in zip(edge.p + edge.q, other.p + other.q, strict=True)), (
                f"edge {(lo, hi)}"
            )


def test_under_the_wrapper_each_steps_metrics_row_counts_the_all_reduce_or_the_gossip_bytes(tmp_path):
    def run(comm) -> dict:
        algorithm = gossip.PeriodicAverage(gossip.PowerGossip(rank=1), every=2)
        return train(comm, 4, algorithm=algorithm, run_dir=tmp_path)

    gossip.simulate(4, run)
    rows = [json.loads(line) for line in (tmp_path / "metrics_rank0.jsonl").read_text().splitlines()]
    model_bytes = flat_parameters(make_mlp(0)).numel() * 4
    gossip_bytes = {rows[0]["bytes_sent"], rows[2]["bytes_sent"]}
    assert [row["bytes_sent"] for row in rows[1::2]] == [round(2 * 3 / 4 * model_bytes)] * 2
    assert len(gossip_bytes) == 1 and gossip_bytes.pop() < model_bytes / 2  # PowerGossip r=1's factors


@pytest.mark.parametrize("inner", INNER)
def test_gossip_right_after_an_average_keeps_identical_replicas_identical(inner):
    """Without local updates in between, the gossip steps after an average mix identical replicas: nothing moves."""
    results = gossip.simulate(4, run_steps, f"pga{EVERY}-{inner}", "hypercube", steps=EVERY + 2)
    for rank, result in enumerate(results[1:], start=1):
        assert all(torch.equal(a, b) for a, b in zip(result["buffers"], results[0]["buffers"], strict=True)), (
            f"rank {rank}'s replica left rank 0's after the average"
        )
