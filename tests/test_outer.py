"""gossip.OuterOptimizer on the simulator: with All-Reduce it is DiLoCo bit for bit; with gossip the sum of the
pseudo-gradients is preserved and the ranks' mean anchor takes the outer step of the mean pseudo-gradient; the
delayed (streaming) update equals a hand-written float64 reference; a hybrid sends the per-step gossip on the other
steps only; resume mid-period and mid-flight is bit-identical; close() completes a synchronisation in flight; and
its refusals. Gloo and MPI against the simulator: test_outer_backends.py."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.outer_scenarios import local_buckets, nan_replica_message, outer_resume
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap

import gossip
import topologies
from gossip.algorithms.base import COLLECTIVE

N = 4


def update(rank: int, step: int, like: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for rank ``rank``'s local update of step ``step``."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return 0.05 * torch.randn(like.shape, generator=generator, dtype=like.dtype)


def apply_update(buckets: list, rank: int, step: int) -> None:
    """Add :func:`update` of the whole (concatenated) replica to the buckets."""
    flat = update(rank, step, torch.cat([b.buffer for b in buckets]))
    offset = 0
    for bucket in buckets:
        bucket.buffer.add_(flat[offset : offset + bucket.buffer.numel()])
        offset += bucket.buffer.numel()


# -- with All-Reduce it is DiLoCo -----------------------------------------------------------------------------
def train(comm, algorithm: gossip.Algorithm, steps: int) -> dict:
    model = wrap(comm, make_mlp(comm.rank), algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sent = []
    for step in range(steps):
        loss_of(model, *batch(comm.rank, step)).backward()
        model.finish_mixing()
        sent.append(dict(algorithm.traffic.last_sent))
        optimizer.step()
        optimizer.zero_grad()
    final = torch.cat([b.buffer for b in model.buckets]).clone()
    theta = torch.cat(algorithm.synchronised()).clone()
    model.close()
    return {"final": final, "theta": theta, "sent": sent, "outer_steps": algorithm.outer_steps}


def test_with_all_reduce_it_is_diloco_bit_for_bit():
    outer = gossip.simulate(N, lambda comm: train(comm, gossip.OuterOptimizer(gossip.AllReduce(), 3), 10))
    diloco = gossip.simulate(N, lambda comm: train(comm, gossip.DiLoCo(local_steps=3), 10))
    for rank in range(N):
        assert torch.equal(outer[rank]["final"], diloco[rank]["final"]), f"rank {rank}"
        assert torch.equal(outer[rank]["theta"], diloco[rank]["theta"]), f"rank {rank}"
        assert outer[rank]["sent"] == diloco[rank]["sent"]
        assert outer[rank]["outer_steps"] == diloco[rank]["outer_steps"] == 3


# -- gossip averaging: the sum invariant ------------------------------------------------------------------------
def gossip_syncs(comm, averaging: str, steps: int = 8) -> list[dict]:
    """OuterOptimizer(averaging, H = 2) on bare buckets with a local update after every step; at every
    synchronisation: this rank's Delta_i (before it lands), its average, theta and v before and after."""
    buckets = local_buckets(comm.rank)
    part = gossip.ExactGossip() if averaging == "exact" else gossip.PowerGossip(rank=1, min_compression=1)
    algorithm = gossip.OuterOptimizer(part, 2, outer_lr=0.7, outer_momentum=0.9)
    schedule = topologies.ring(comm.size) if averaging == "exact" else topologies.one_peer_hypercube(comm.size)
    algorithm.setup(comm, schedule, buckets)
    rows = []
    for step in range(steps):
        before = [torch.cat(t).clone() for t in (algorithm.synchronised(), algorithm._momentum)]
        pending = algorithm.start(step)
        own = torch.cat(algorithm.pseudo_gradients()).clone()
        algorithm.finish(pending)
        if algorithm.period.ends(step):
            after = [torch.cat(t).clone() for t in (algorithm.synchronised(), algorithm._momentum)]
            rows.append({"own": own, "mixed": torch.cat(algorithm.pseudo_gradients()).clone(), "before": before})
            rows[-1]["after"] = after
        apply_update(buckets, comm.rank, step)
    return rows


@pytest.mark.parametrize("averaging", ["exact", "powergossip"])
def test_gossip_preserves_the_sum_of_the_pseudo_gradients_and_the_mean_takes_the_outer_step(averaging):
    """sum_i Delta-hat_i = sum_i Delta_i at every synchronisation (doubly stochastic ring; PowerGossip's equal and
    opposite corrections on the hypercube), to float64 rounding; the mean anchor and momentum take the outer step
    of the mean pseudo-gradient, written out; and the anchors differ between ranks (each rank's state is its own)."""
    per_rank = gossip.simulate(N, gossip_syncs, averaging)
    for sync in range(len(per_rank[0])):
        rows = [rank_rows[sync] for rank_rows in per_rank]
        own, mixed = torch.stack([r["own"] for r in rows]), torch.stack([r["mixed"] for r in rows])
        torch.testing.assert_close(mixed.sum(0), own.sum(0), rtol=0, atol=1e-13)
        assert not torch.allclose(mixed[0], own.mean(0)), "gossip is not an all-reduce: rank 0's average differs"
        theta, v = (torch.stack([r["before"][i] for r in rows]).mean(0) for i in (0, 1))
        delta = own.mean(0)
        v = delta if sync == 0 else 0.9 * v + delta
        theta = theta - 0.7 * (delta + 0.9 * v)
        torch.testing.assert_close(torch.stack([r["after"][0] for r in rows]).mean(0), theta, rtol=0, atol=1e-13)
        torch.testing.assert_close(torch.stack([r["after"][1] for r in rows]).mean(0), v, rtol=0, atol=1e-13)
    assert not torch.equal(per_rank[0][-1]["after"][0], per_rank[1][-1]["after"][0])


# -- the delayed (streaming) update -------------------------------------------------------------------------------
def delayed_run(comm, averaging: str, delay: int, merge: float, steps: int) -> list[torch.Tensor]:
    buckets = local_buckets(comm.rank)
    part = gossip.AllReduce() if averaging == "allreduce" else gossip.ExactGossip()
    algorithm = gossip.OuterOptimizer(part, 3, outer_lr=0.7, outer_momentum=0.9, delay=delay, merge=merge)
    algorithm.setup(comm, topologies.ring(comm.size), buckets)
    replicas = []
    for step in range(steps):
        algorithm.step(step)  # start, then finish before the update, as in the wrapper
        replicas.append(torch.cat([b.buffer for b in buckets]).clone())
        apply_update(buckets, comm.rank, step)
    return replicas


def reference(averaging: str, delay: int, merge: float, steps: int) -> list[list[torch.Tensor]]:
    """The module docstring's time line written out in float64: start at (t + 1) % 3 == 0 with Delta_i = theta_i -
    x_i, averaged over all ranks or over the ring's W (1/3 to itself and each neighbour); land at t + delay:
    Nesterov outer step, then x_i <- theta_i + merge (x_i - theta_i) (x_i <- theta_i without delay)."""
    x = [torch.cat([b.buffer for b in local_buckets(rank)]) for rank in range(N)]
    theta = [x[0].clone() for _ in range(N)]  # rank 0's parameters, broadcast
    v: list[torch.Tensor | None] = [None] * N
    inflight, out = None, [[] for _ in range(N)]
    for t in range(steps):
        if (t + 1) % 3 == 0:
            delta = [theta[i] - x[i] for i in range(N)]
            if averaging == "allreduce":
                mixed = [torch.stack(delta).mean(0)] * N
            else:
                mixed = [(delta[(i - 1) % N] + delta[i] + delta[(i + 1) % N]) / 3 for i in range(N)]
            inflight = (t + delay, mixed)
        if inflight is not None and inflight[0] == t:
            for i in range(N):
                d = inflight[1][i]
                v[i] = d if v[i] is None else 0.9 * v[i] + d
                theta[i] = theta[i] - 0.7 * (d + 0.9 * v[i])
                x[i] = theta[i] + merge * (x[i] - theta[i]) if delay else theta[i].clone()
            inflight = None
        for i in range(N):
            out[i].append(x[i].clone())
            x[i] = x[i] + update(i, t, x[i])
    return out


@pytest.mark.parametrize(
    ("averaging", "delay", "merge"), [("allreduce", 1, 0.5), ("allreduce", 2, 0.0), ("exact", 1, 0.25), ("exact", 0, 0)]
)
def test_the_delayed_update_equals_a_hand_written_reference_in_float64(averaging, delay, merge):
    steps = 11
    got = gossip.simulate(N, delayed_run, averaging, delay, merge, steps)
    want = reference(averaging, delay, merge, steps)
    for rank in range(N):
        for step in range(steps):
            torch.testing.assert_close(got[rank][step], want[rank][step], rtol=0, atol=1e-12, msg=f"{rank} {step}")
    if delay:  # the replica after the step that started a synchronisation is not reset: training goes on
        assert not torch.equal(got[0][2], got[1][2])


# -- hybrids: per-step gossip between the synchronisations -----------------------------------------------------
def test_a_hybrid_sends_the_gossip_on_the_other_steps_and_the_averaging_on_the_synchronisations():
    def run(comm):
        algorithm = gossip.OuterOptimizer(gossip.AllReduce(), 3, between=gossip.ExactGossip())
        result = train(comm, algorithm, 9)
        result["model_bytes"] = result["final"].numel() * 4
        return result

    for result in gossip.simulate(N, run):
        for step, sent in enumerate(result["sent"]):
            if step in (2, 5, 8):
                assert list(sent) == [COLLECTIVE], f"step {step}: {sent}"
            else:  # one peer of the hypercube, the whole model
                assert list(sent.values()) == [result["model_bytes"]], f"step {step}: {sent}"


def test_an_outer_step_with_lr_1_and_no_momentum_is_the_exact_average_of_the_replicas():
    """The main job's defaults: PowerGossip every step, and on every third step (H = 3 here) the replicas become
    the mean of the replicas the previous update left, on every rank; between, they differ."""

    def run(comm):
        between = gossip.PowerGossip(rank=2, num_iterations=2, message_dtype=torch.float16)
        algorithm = gossip.OuterOptimizer(gossip.AllReduce(), 3, outer_lr=1.0, outer_momentum=0.0, between=between)
        model = wrap(comm, make_mlp(comm.rank), algorithm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        updated, mixed = [], []
        for step in range(8):
            loss_of(model, *batch(comm.rank, step)).backward()
            model.finish_mixing()
            mixed.append(torch.cat([b.buffer for b in model.buckets]).clone())
            optimizer.step()
            optimizer.zero_grad()
            updated.append(torch.cat([b.buffer for b in model.buckets]).clone())
        model.close()
        return {"updated": updated, "mixed": mixed}

    results = gossip.simulate(N, run)
    for step in range(1, 8):
        mean = torch.stack([result["updated"][step - 1] for result in results]).mean(0)
        if step in (2, 5):
            for rank, result in enumerate(results):
                torch.testing.assert_close(result["mixed"][step], mean, rtol=0, atol=1e-6, msg=f"{rank} {step}")
        else:
            assert not torch.equal(results[0]["mixed"][step], results[1]["mixed"][step]), f"step {step}"


def test_between_counts_its_own_steps_so_a_time_varying_schedule_cycles_through_its_phases():
    algorithm = gossip.OuterOptimizer(gossip.AllReduce(), 4, between=gossip.ExactGossip())
    steps = [t for t in range(12) if not algorithm.period.ends(t)]
    assert [algorithm.period.between(t) for t in steps] == list(range(9))


# -- checkpoints ---------------------------------------------------------------------------------------------------
CONFIGS = {
    "gossip-hybrid": lambda: gossip.OuterOptimizer(
        gossip.ExactGossip(), 3, between=gossip.PowerGossip(rank=1, min_compression=1)
    ),
    "powergossip-delayed": lambda: gossip.OuterOptimizer(
        gossip.PowerGossip(rank=1, min_compression=1), 3, delay=1, merge=0.5, between=gossip.ExactGossip()
    ),
    "allreduce-delay-2": lambda: gossip.OuterOptimizer(gossip.AllReduce(), 4, delay=2, merge=0.5),
}


@pytest.mark.parametrize(
    ("config", "save_at", "in_flight"),
    [
        ("gossip-hybrid", 4, None),
        ("powergossip-delayed", 3, 2),
        ("allreduce-delay-2", 5, 3),
        ("allreduce-delay-2", 4, 3),
    ],
)
def test_a_run_resumed_mid_period_or_mid_flight_is_bit_identical(tmp_path, config, save_at, in_flight):
    """Saved after ``save_at`` steps; ``in_flight``: the step whose synchronisation is still in flight then (saved
    with this rank's pseudo-gradients and posted again on resume). Parameters, anchors and momenta after 10 steps
    are the uninterrupted run's, bit for bit."""
    for rank, result in enumerate(gossip.simulate(N, outer_resume, tmp_path, CONFIGS[config], 10, save_at)):
        assert result["resumed_at"] == save_at
        assert (result["inflight"] or {}).get("step") == in_flight
        (params, state), (resumed_params, resumed_state) = result["uninterrupted"], result["resumed"]
        assert torch.equal(params, resumed_params), f"rank {rank}: parameters"
        for key in ("sync", "momentum"):
            pairs = zip(state[key], resumed_state[key], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), f"rank {rank}: {key}"


def test_close_completes_a_synchronisation_still_in_flight():
    """H = 4, delay 2: after 4 steps the synchronisation of step 3 is in flight (it lands at step 5); close()
    completes it on every rank and returns."""

    def run(comm) -> int:
        algorithm = gossip.OuterOptimizer(gossip.ExactGossip(), 4, delay=2)
        model = wrap(comm, make_mlp(comm.rank), algorithm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert algorithm._inflight is not None
        model.close()
        return algorithm._inflight is None

    assert gossip.simulate(N, run, timeout=20.0) == [True] * N


# -- refusals --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"local_steps": 0}, "local_steps must be an integer >= 1"),
        ({"outer_lr": -1.0}, "outer_lr must be a positive finite number"),
        ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
        ({"delay": 3}, "delay must be an integer in [0, local_steps) = [0, 3)"),
        ({"merge": 1.5}, "merge must be a number in [0.0, 1.0]"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(kwargs, says):
    settings = {"local_steps": 3, **kwargs}
    with pytest.raises(ValueError, match=re.escape(f"OuterOptimizer: {says}")):
        gossip.OuterOptimizer(gossip.ExactGossip(), **settings)


def test_an_averaging_that_is_not_an_algorithm_is_refused():
    with pytest.raises(TypeError, match=r"OuterOptimizer: averaging must be a gossip\.Algorithm, got str"):
        gossip.OuterOptimizer("allreduce")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::gossip.errors.NonFiniteWarning")  # the neighbours' drops (threads: not caught)
def test_a_replica_holding_nan_is_named_by_its_own_rank_with_gossip_averaging():
    """Rank 1's replica holds NaN; its ring neighbours drop what it sent (nonfinite='drop'), and rank 1 itself
    finds its averaged pseudo-gradient non-finite and says whose replica it is."""
    messages = gossip.simulate(
        N, nan_replica_message, lambda: gossip.OuterOptimizer(gossip.ExactGossip(nonfinite="drop"), 1), "ring"
    )
    assert messages[1].startswith("rank 1: step 0: OuterOptimizer's averaged pseudo-gradient is non-finite")
    assert "this rank's replica holds NaN or Inf" in messages[1]
    assert messages[0] == messages[2] == messages[3] == "accepted"


def test_config_names_the_parts_and_a_state_of_another_config_is_refused():
    algorithm = gossip.OuterOptimizer(gossip.ExactGossip(), 5, between=gossip.PowerGossip())
    config = algorithm.config()
    assert config["averaging"]["name"] == "exact" and config["between"]["name"] == "powergossip"
    assert (config["local_steps"], config["delay"], config["merge"]) == (5, 0, 0.0)

    def reload(comm) -> str:
        first = gossip.OuterOptimizer(gossip.ExactGossip(), 4)
        first.setup(comm, topologies.ring(comm.size), local_buckets(comm.rank))
        other = gossip.OuterOptimizer(gossip.ExactGossip(), 4, delay=1)
        other.setup(comm, topologies.ring(comm.size), local_buckets(comm.rank))
        with pytest.raises(ValueError, match=r"saved with .*'delay': 0.*this run uses .*'delay': 1"):
            other.load_state_dict(first.state_dict())
        return "refused"

    assert gossip.simulate(2, reload) == ["refused"] * 2
