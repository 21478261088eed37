"""The learning-per-step study's own pieces: CHOCO-Gossip, the noise-debiased and smoothed-second-moment AdamWs, the
adapt-then-combine diagnostic, the spectrum measurement and the report's aggregation (experiments/learning_per_step/:
study.py, mixing.py, optimizers.py, spectrum.py, report.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.adam_reference import where_adams_m_squared_exceeds_v

import gossip
import topologies
from experiments.learning_per_step.mixing import ChocoTopK
from experiments.learning_per_step.optimizers import (
    NoiseDebiasedAdamW,
    SharedSecondMomentAdamW,
    SmoothedSecondMomentAdamW,
    TrackedMomentumAdamW,
)
from experiments.learning_per_step.report import config_table, merged_rows, steps_to_target
from experiments.learning_per_step.spectrum import capture_shares, spectrum_rows
from experiments.learning_per_step.study import RunConfig, make_algorithm, make_optimizer, tracking, train_run
from gossip.algorithms.buckets import pack
from gossip.wrapper.peer_agreement import MESSAGE_BYTES


def _random_buckets(rank: int, shape=(24, 12)) -> list:
    generator = torch.Generator().manual_seed(1000 + rank)
    return pack([("w", torch.randn(*shape, generator=generator, dtype=torch.float64))])


def _choco(comm, steps: int):
    algorithm = ChocoTopK(fraction=0.1, gamma=0.4)
    buckets = _random_buckets(comm.rank)
    algorithm.setup(comm, topologies.ring(comm.size), buckets)
    total_before = buckets[0].buffer.clone()
    comm.all_reduce(total_before, "sum")
    for step in range(steps):
        algorithm.step(step)
    total_after = buckets[0].buffer.clone()
    comm.all_reduce(total_after, "sum")
    spread = buckets[0].buffer.clone()
    comm.all_reduce(spread, "avg")
    distance = float((buckets[0].buffer - spread).square().sum())
    publics = comm.all_gather_object({p: [t.clone() for t in copies] for p, copies in algorithm.public.items()})
    return total_before, total_after, distance, publics


def test_choco_preserves_the_sum_keeps_public_copies_identical_and_contracts():
    before = gossip.simulate(6, _choco, 0)[0][2]
    results = gossip.simulate(6, _choco, 200)
    total_before, total_after, after, publics = results[0]
    torch.testing.assert_close(total_after, total_before, rtol=0, atol=1e-10)
    assert after < 1e-2 * before  # error feedback: what top-10% leaves out is sent later
    for holder, copies in enumerate(publics):  # every holder's copy of rank j's public x_hat equals rank j's own
        for owner, tensors in copies.items():
            for mine, theirs in zip(tensors, publics[owner][owner], strict=True):
                assert torch.equal(mine, theirs), f"rank {holder}'s copy of rank {owner}'s public model differs"


def test_capture_shares_of_a_known_spectrum():
    u, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(10, 10, dtype=torch.float64))
    singular = torch.tensor([3.0, 2.0, 1.0] + [0.0] * 7, dtype=torch.float64)
    shares, stable_rank = capture_shares(u[:, :10] @ torch.diag(singular) @ v.T, ranks=(1, 2, 4))
    assert shares == pytest.approx([9 / 14, 13 / 14, 1.0])
    assert stable_rank == pytest.approx(14 / 9)


def _next_edge(comm):
    algorithm = gossip.PowerGossip(rank=1, min_compression=1)
    buckets = _random_buckets(comm.rank)
    algorithm.setup(comm, topologies.one_peer_hypercube(2), buckets)
    algorithm.step(0)
    pending = algorithm.start(1)  # the next exchange, posted: its factor is the one the measurement reads
    replicas = comm.all_gather_object({"w": buckets[0].buffer.view(24, 12).clone()})
    rows = spectrum_rows("t", 0, 1, replicas, algorithm) if comm.rank == 0 else []
    algorithm.finish(pending)
    after = comm.all_gather_object(buckets[0].buffer.clone())
    return rows, replicas, after


def test_powergossip_capture_is_what_the_step_removes_and_at_most_the_best_rank_one_share():
    rows, before, after = gossip.simulate(2, _next_edge)[0]
    edge = next(r for r in rows if r["kind"] == "next_edge")
    energy_before = float((before[1]["w"] - before[0]["w"]).square().sum())
    energy_after = float((after[1] - after[0]).square().sum())
    # gamma = 1, weight 1/2 on both ends: the edge's difference loses exactly its projection on the factor
    assert energy_after / energy_before == pytest.approx(1 - edge["pg_captured"], rel=1e-9)
    assert 0 < edge["pg_captured"] <= edge["share_r1"] + 1e-12  # Eckart-Young bound


def test_report_pairs_gaps_by_seed_and_counts_steps_to_ddp_final_loss():
    summary = [
        {"config": "ddp", "seed": s, "workers": 8, "steps": 30, "final_train_loss": loss, "val_loss_averaged": 1.0,
         "final_consensus": 0.0, "bytes_per_worker_per_step": 10.0, "ddp_bytes_per_worker_per_step": 10.0,
         "settings": "algorithm=ddp"}
        for s, loss in ((0, 1.0), (1, 2.0))
    ] + [
        {"config": "pg", "seed": s, "workers": 8, "steps": 30, "final_train_loss": loss, "val_loss_averaged": 1.0,
         "final_consensus": 1.0, "bytes_per_worker_per_step": 2.0, "ddp_bytes_per_worker_per_step": 10.0,
         "settings": ""}
        for s, loss in ((0, 1.5), (1, 2.1))
    ]  # fmt: skip
    steps = [
        {"config": "pg", "seed": 0, "step": 10, "train_loss": 3.0, "consensus": 0.9},
        {"config": "pg", "seed": 0, "step": 20, "train_loss": 1.4, "consensus": 0.3},
        {"config": "pg", "seed": 1, "step": 10, "train_loss": 3.0, "consensus": 0.8},
    ]
    pg = next(r for r in config_table(summary, steps) if r["config"] == "pg")
    assert pg["gap"][0] == pytest.approx((0.5 + 0.1) / 2)
    assert pg["ddp_over_bytes"] == 5.0
    assert pg["to_target"] == (1, 2, 20.0)  # target = mean of DDP's final losses, 1.5
    assert pg["late_consensus"] == 0.3  # the records after step 15 of the 30
    assert math.isnan(steps_to_target([(10, 2.0)], 1.5))


def test_report_against_a_named_reference_compares_unequal_step_budgets():
    def run(config, seed, steps, loss):
        return {"config": config, "seed": seed, "workers": 8, "steps": steps, "final_train_loss": loss,
                "val_loss_averaged": 1.0, "final_consensus": 0.0, "bytes_per_worker_per_step": 10.0,
                "ddp_bytes_per_worker_per_step": 10.0,
                "settings": "algorithm=ddp" if config.startswith("ddp") else ""}  # fmt: skip

    summary = [run("ddp-s300", 0, 300, 2.0), run("pg-s500", 0, 500, 1.8), run("mj", 0, 300, 2.5)]
    summary[2]["workers"] = 4
    steps = [{"config": "pg-s500", "seed": 0, "step": t, "train_loss": 2.4 - t / 1000, "consensus": 0.1}
             for t in range(10, 501, 10)]  # fmt: skip
    by_config = {r["config"]: r for r in config_table(summary, steps, reference="ddp-s300")}
    assert by_config["pg-s500"]["reference"] == "ddp-s300"
    assert by_config["pg-s500"]["gap"][0] == pytest.approx(-0.2)
    assert by_config["pg-s500"]["to_target"] == (1, 1, 400)  # first record with loss <= 2.0
    assert by_config["mj"]["reference"] is None  # another number of workers: no reference
    assert config_table(summary, steps)[1]["reference"] is None  # by default only DDP of equal steps


def test_report_finds_the_ddp_run_of_equal_size_and_length_by_its_settings_whatever_its_name():
    def run(config, steps, loss, settings):
        return {"config": config, "seed": 0, "workers": 16, "steps": steps, "final_train_loss": loss,
                "val_loss_averaged": 1.0, "final_consensus": 0.0, "bytes_per_worker_per_step": 10.0,
                "ddp_bytes_per_worker_per_step": 10.0, "settings": settings}  # fmt: skip

    summary = [
        run("n16-ddp-s10", 10, 1.0, "algorithm=ddp, workers=16"),
        run("n16-exact-s10", 10, 1.25, "algorithm=exact, workers=16"),
        run("n16-exact-s20", 20, 1.5, "algorithm=exact, workers=16, steps=20"),
    ]
    by_config = {r["config"]: r for r in config_table(summary, [])}
    assert by_config["n16-exact-s10"]["reference"] == "n16-ddp-s10"
    assert by_config["n16-exact-s10"]["gap"][0] == pytest.approx(0.25)
    assert by_config["n16-exact-s20"]["reference"] is None  # no DDP run of 20 steps
    summary.append(run("n16-ddp-b2-s10", 10, 0.9, "algorithm=ddp, beta2=0.99"))
    assert config_table(summary, [])[1]["reference"] is None  # two DDP runs, neither named ddp: ambiguous


def _trajectory(make, gradients: list[torch.Tensor]) -> torch.Tensor:
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    optimizer = make([{"params": [weight], "weight_decay": 0.1}])
    for gradient in gradients:
        weight.grad = gradient.clone()
        optimizer.step()
    return weight.detach()


def test_noise_debiased_adamw_for_one_worker_is_adamw():
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(64, generator=generator, dtype=torch.float64) + 0.3 for _ in range(40)]
    ours = _trajectory(lambda g: NoiseDebiasedAdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, workers=1), gradients)
    adamw = _trajectory(lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8), gradients)
    torch.testing.assert_close(ours, adamw, rtol=0, atol=1e-12)


def test_noise_debiased_adamw_divides_pure_noise_by_the_mean_gradients_second_moment():
    """Zero-mean noise of variance s^2: AdamW divides by ~s, DDP's Adam (mean over n) by ~s / sqrt(n); the
    debiased estimate lands near the latter, so the step on noise is ~sqrt(n) times AdamW's (bounded by the floor
    v / n, which is exactly sqrt(n))."""
    generator = torch.Generator().manual_seed(1)
    n, scale = 8, 0.5
    gradients = [scale * torch.randn(4096, generator=generator, dtype=torch.float64) for _ in range(200)]
    states = {}
    for name, make in {
        "debiased": lambda g: NoiseDebiasedAdamW(g, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, workers=n),
        "adamw": lambda g: NoiseDebiasedAdamW(g, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, workers=1),
    }.items():
        weight = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float64))
        optimizer = make([{"params": [weight]}])
        for gradient in gradients:
            weight.grad = gradient.clone()
            before = weight.detach().clone()
            optimizer.step()
        states[name] = (weight.detach() - before).abs().mean().item()
    ratio = states["debiased"] / states["adamw"]
    assert math.sqrt(n) * 0.8 < ratio <= math.sqrt(n) * 1.0001, ratio


def test_smoothed_second_moment_adamw_without_smoothing_is_adamw():
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(64, generator=generator, dtype=torch.float64) + 0.3 for _ in range(40)]
    ours = _trajectory(
        lambda g: SmoothedSecondMomentAdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, v_beta=0.0), gradients
    )
    adamw = _trajectory(lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8), gradients)
    torch.testing.assert_close(ours, adamw, rtol=0, atol=1e-12)


def test_smoothed_second_moment_of_pure_noise_is_that_of_the_mean_of_n_workers():
    """v_beta = (n-1)/(n+1): the EMA's stationary noise variance is s^2 / n, the variance of the mean of n workers'
    gradients, so v settles near s^2 / n where AdamW's settles near s^2."""
    generator = torch.Generator().manual_seed(2)
    n, scale = 8, 0.5
    weight = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float64))
    optimizer = SmoothedSecondMomentAdamW([weight], lr=0.0, betas=(0.9, 0.95), eps=1e-8, v_beta=(n - 1) / (n + 1))
    for _ in range(400):
        weight.grad = scale * torch.randn(4096, generator=generator, dtype=torch.float64)
        optimizer.step()
    v = optimizer.state[weight]["v"].mean().item()
    assert v == pytest.approx(scale**2 / n, rel=0.1)


def test_shared_second_moment_sampled_every_step_from_ones_own_gradient_is_adamw():
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(64, generator=generator, dtype=torch.float64) + 0.3 for _ in range(40)]
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    optimizer = SharedSecondMomentAdamW(
        [{"params": [weight], "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, every=1, floor=1
    )
    for gradient in gradients:
        weight.grad = gradient.clone()
        optimizer.sample({weight: gradient})
        optimizer.step()
    adamw = _trajectory(lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8), gradients)
    torch.testing.assert_close(weight.detach(), adamw, rtol=0, atol=1e-12)


def test_shared_second_moment_makes_the_mean_of_the_workers_steps_adamws_step_on_the_mean_gradient():
    """n workers, each with its own gradients, v sampled from their mean every step: averaging the replicas after
    every step follows AdamW fed the mean gradient (the update is linear in each worker's first moment); with each
    worker's own v it does not."""
    generator = torch.Generator().manual_seed(3)
    n, steps = 4, 30
    gradients = [
        [torch.randn(64, generator=generator, dtype=torch.float64) + 0.3 for _ in range(n)] for _ in range(steps)
    ]
    workers = [torch.nn.Parameter(torch.ones(64, dtype=torch.float64)) for _ in range(n)]
    shared = [
        SharedSecondMomentAdamW([{"params": [w], "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, 1, None)
        for w in workers
    ]
    local = [torch.nn.Parameter(torch.ones(64, dtype=torch.float64)) for _ in range(n)]
    own = [
        torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8) for w in local
    ]
    for step in gradients:
        mean = torch.stack(step).mean(0)
        for replicas, optimizers, sample in ((workers, shared, True), (local, own, False)):
            for weight, optimizer, gradient in zip(replicas, optimizers, step, strict=True):
                weight.grad = gradient.clone()
                if sample:
                    optimizer.sample({weight: mean})
                optimizer.step()
            with torch.no_grad():
                average = torch.stack([w.detach() for w in replicas]).mean(0)
                for weight in replicas:
                    weight.copy_(average)
    ddp = _trajectory(
        lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8),
        [torch.stack(s).mean(0) for s in gradients],
    )
    torch.testing.assert_close(workers[0].detach(), ddp, rtol=0, atol=1e-12)
    assert (local[0].detach() - ddp).abs().max() > 1e-4  # each worker's own v: not DDP's step


def test_shared_second_moment_is_floored_by_the_workers_own_where_the_last_sample_was_zero():
    """A coordinate whose mean gradient was 0 at the last sample (an embedding row no batch touched) but whose
    local gradient is not: without the floor the step divides by eps; with it, by the local second moment / n."""
    n = 8
    steps = {}
    for floor in (None, n):
        weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        optimizer = SharedSecondMomentAdamW([weight], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, every=32, floor=floor)
        weight.grad = torch.zeros(4, dtype=torch.float64)
        optimizer.sample({weight: torch.zeros(4, dtype=torch.float64)})
        optimizer.step()
        weight.grad = torch.full((4,), 0.5, dtype=torch.float64)  # the row is touched at the next step
        optimizer.step()
        steps[floor] = weight.detach().abs().max().item()
    assert steps[None] > 1.0  # lr 1e-3 multiplied by about m / eps
    assert steps[n] < 1e-3 * math.sqrt(n) * 1.5  # about lr sqrt(n): AdamW's step, sqrt(n) larger


def _tracked(weight: torch.nn.Parameter, v_source: str, workers: int = 1, floor: bool = True) -> TrackedMomentumAdamW:
    group = [{"params": [weight], "weight_decay": 0.1}]
    return TrackedMomentumAdamW(group, 1e-2, (0.9, 0.95), 1e-8, v_source, workers, every=1, local_floor=floor)


def test_tracked_momentum_with_a_complete_mixing_and_the_mean_gradients_v_is_ddp():
    """W = J (every tracker the mean of the first moments, as an exact tracker on a complete graph gives) and v
    sampled from the mean gradient every step: without the local floor every replica takes AdamW's step on the mean
    gradient, so they stay identical without any parameter averaging. Each rank's own v does not, and neither does
    the floor by each rank's own v / n, where it binds (here, where the mean gradient is small)."""
    generator = torch.Generator().manual_seed(3)
    n, steps = 4, 30
    gradients = [
        [torch.randn(64, generator=generator, dtype=torch.float64) + 0.3 for _ in range(n)] for _ in range(steps)
    ]
    runs = {}
    for name, v_source, floor in (("shared", "shared", False), ("floored", "shared", True), ("local", "local", True)):
        workers = [torch.nn.Parameter(torch.ones(64, dtype=torch.float64)) for _ in range(n)]
        optimizers = [_tracked(w, v_source, workers=n, floor=floor) for w in workers]
        for step in gradients:
            for weight, optimizer, gradient in zip(workers, optimizers, step, strict=True):
                weight.grad = gradient.clone()
                if optimizer.mean_gradient_due():
                    optimizer.take_mean_gradient({weight: torch.stack(step).mean(0)}, n)
                optimizer.prepare_momentum()  # .grad <- h_i
            tracker = torch.stack([w.grad for w in workers]).mean(0)  # the tracker's mean: the mean first moment
            for weight, optimizer in zip(workers, optimizers, strict=True):
                weight.grad = tracker.clone()
                optimizer.step()
        runs[name] = workers
    means = [torch.stack(s).mean(0) for s in gradients]
    ddp = _trajectory(lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8), means)
    floored = where_adams_m_squared_exceeds_v(means, (0.9, 0.95))  # there the z^2 floor shortens the step
    assert floored.sum() < 4
    for weight in runs["shared"]:
        torch.testing.assert_close(weight.detach()[~floored], ddp[~floored], rtol=0, atol=1e-12)
        torch.testing.assert_close(weight.detach()[floored], ddp[floored], rtol=0, atol=1e-4)
    for name in ("floored", "local"):
        assert (runs[name][0].detach() - ddp).abs().max() > 1e-4  # not DDP's step
        assert (runs[name][0].detach() - runs[name][1].detach()).abs().max() > 1e-4  # and the replicas drift


def test_tracked_momentum_adamw_refuses_an_unknown_source():
    weight = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="v_source"):
        _tracked(weight, "global")


def test_momentum_tracking_on_two_workers_with_the_mean_gradients_v_stays_with_ddp():
    """n = 2 on the one-peer hypercube: W = J every step, so both exact trackers are the mean first moment and, with
    v sampled from the mean gradient every step, both replicas take DDP's step but where a floor binds (each rank's
    own v / n: where the two gradients cancel). They stay far closer to each other and to DDP than exact gossip's."""
    tiny = {"workers": 2, "batch": 2, "steps": 4, "warmup": 1}
    tracked = {"algorithm": "exact", "gradient_tracking": True, "optimizer": "tracked-m-adamw"}
    runs = {
        name: train_run(RunConfig(name, **settings, **tiny), seed=0)["summary"][0]
        for name, settings in {
            "ddp": {"algorithm": "ddp"},
            "exact": {"algorithm": "exact"},
            "exact-mt-sharedv1": {**tracked, "v_source": "shared", "v_every": 1},
        }.items()
    }
    tracked_run, exact, ddp = runs["exact-mt-sharedv1"], runs["exact"], runs["ddp"]
    assert 0 < tracked_run["final_consensus"] < exact["final_consensus"] / 4
    for key in ("final_train_loss", "val_loss_averaged"):
        assert abs(tracked_run[key] - ddp[key]) < abs(exact[key] - ddp[key]) / 3


def test_trackers_by_powergossip_take_the_configurations_powergossip_and_bad_settings_are_refused():
    config = RunConfig("t", gradient_tracking="powergossip", rank=4, iterations=2, message_dtype="float16")
    trackers = tracking(config)
    assert isinstance(trackers, gossip.PowerGossip)
    assert trackers.config()["rank"] == 4 and trackers.config()["num_iterations"] == 2
    assert tracking(RunConfig("t", gradient_tracking=True)) is True
    with pytest.raises(ValueError, match="gradient_tracking must be"):
        tracking(RunConfig("t", gradient_tracking="exact-ish"))


def test_adapt_then_combine_keeps_the_replicas_identical_at_ddps_bytes():
    config = RunConfig("atc", algorithm="atc", workers=2, batch=2, steps=3, warmup=1)
    summary = train_run(config, seed=0)["summary"][0]
    assert summary["final_consensus"] == 0.0
    assert summary["bytes_per_worker_per_step"] == summary["ddp_bytes_per_worker_per_step"]
    assert math.isfinite(summary["final_train_loss"])


def test_diloco_sends_an_all_reduce_of_the_parameters_every_local_steps_steps():
    """H = 2 over 4 steps: two synchronisations, each DDP's bytes (a ring all-reduce of the model), so half of
    DDP's bytes per step."""
    config = RunConfig("diloco", algorithm="diloco", local_steps=2, workers=2, batch=2, steps=4, warmup=1)
    summary = train_run(config, seed=0)["summary"][0]
    assert summary["bytes_per_worker_per_step"] == summary["ddp_bytes_per_worker_per_step"] / 2
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["val_loss_averaged"])


def test_diloco_configurations_build_gossip_diloco_and_refuse_a_periodic_average():
    algorithm = make_algorithm(RunConfig("d", algorithm="diloco", local_steps=7, outer_lr=0.5, outer_momentum=0.8))
    assert isinstance(algorithm, gossip.DiLoCo)
    assert algorithm.config() == {"local_steps": 7, "outer_lr": 0.5, "outer_momentum": 0.8, "nesterov": True}
    with pytest.raises(ValueError, match="diloco synchronises every local_steps steps"):
        make_algorithm(RunConfig("d", algorithm="diloco", average_every=4))


@pytest.mark.parametrize(
    "optimizer", ["adamw", "accum-adamw", "debiased-adamw", "smoothed-v-adamw", "shared-v-adamw", "tracked-m-adamw"]
)
def test_every_adam_of_the_study_takes_the_configured_betas(optimizer):
    """A configuration's beta1 and beta2 reach the optimizer it names, whichever it is (the betas study compares
    runs that differ in nothing else)."""
    module = torch.nn.Linear(4, 3)
    config = RunConfig(name="betas", optimizer=optimizer, beta1=0.8, beta2=0.99, accum_iter=2)
    groups = make_optimizer(config, module).param_groups
    assert {group["betas"] for group in groups} == {(0.8, 0.99)}


def test_gradient_tracking_on_two_workers_is_ddp_and_sends_a_second_model_per_step():
    """n = 2 on the one-peer hypercube: W = J every step, so each tracker is the mean gradient (summed in rank order,
    the same bits on both ranks) and the replicas, identical after the broadcast, stay identical and follow DDP's
    trajectory up to float rounding; the trackers' exchange adds one model per step to exact gossip's bytes (and the
    optimizers' comparison its message once)."""
    tiny = {"workers": 2, "batch": 2, "steps": 4, "warmup": 1}
    runs = {
        name: train_run(RunConfig(name, **settings, **tiny), seed=0)["summary"][0]
        for name, settings in {
            "ddp": {"algorithm": "ddp"},
            "exact": {"algorithm": "exact"},
            "exact-gt": {"algorithm": "exact", "gradient_tracking": True},
        }.items()
    }
    tracked = runs["exact-gt"]
    assert tracked["final_consensus"] == 0.0
    assert runs["exact"]["final_consensus"] > 0.0  # without tracking each rank steps on its own gradient
    assert tracked["final_train_loss"] == pytest.approx(runs["ddp"]["final_train_loss"], abs=1e-5)
    assert tracked["val_loss_averaged"] == pytest.approx(runs["ddp"]["val_loss_averaged"], abs=1e-5)
    model_bytes = runs["ddp"]["ddp_bytes_per_worker_per_step"]  # 2 (n - 1) / n M = M at n = 2
    comparison = MESSAGE_BYTES / tiny["steps"]  # the optimizers compared with the one peer at step 1
    extra = tracked["bytes_per_worker_per_step"] - runs["exact"]["bytes_per_worker_per_step"]
    assert extra == pytest.approx(model_bytes + comparison, abs=1e-9)
    assert "gradient_tracking=True" in tracked["settings"]


def test_report_reads_each_run_from_the_first_directory_that_has_it(tmp_path):
    """A run repeated in a later directory (a reproduction check) is neither counted twice nor mixed in."""
    first, second = tmp_path / "new", tmp_path / "old"
    first.mkdir()
    second.mkdir()
    header = "config,seed,final_train_loss\n"
    (first / "summary.csv").write_text(header + "exact-gt,0,1.0\nddp,0,1.5\n")
    (second / "summary.csv").write_text(header + "ddp,0,9.0\nddp,1,1.7\n")
    rows = merged_rows([first, second], "summary")
    assert [(r["config"], r["seed"], r["final_train_loss"]) for r in rows] == [
        ("exact-gt", 0, 1.0), ("ddp", 0, 1.5), ("ddp", 1, 1.7)
    ]  # fmt: skip
    assert merged_rows([first, second], "steps") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "settings",
    [{"algorithm": "ddp"}, {"algorithm": "exact"}, {"rank": 4, "iterations": 2, "message_dtype": "float16"}],
    ids=["ddp", "exact", "defaults"],
)
def test_a_run_on_cuda_follows_the_same_run_on_the_cpu(settings):
    """``--device cuda``: every virtual rank's model, batches and the study's own collectives on the GPU; the curve
    equals the CPU run's up to float rounding (CUDA orders its reductions differently), bytes exactly."""
    config = RunConfig("on-device", **settings, workers=4, batch=2, steps=6, warmup=2)
    on_cpu, on_cuda = (train_run(config, seed=0, device=device)["summary"][0] for device in ("cpu", "cuda"))
    assert on_cuda["final_train_loss"] == pytest.approx(on_cpu["final_train_loss"], abs=2e-3)
    assert on_cuda["val_loss_averaged"] == pytest.approx(on_cpu["val_loss_averaged"], abs=2e-3)
    assert on_cuda["bytes_per_worker_per_step"] == on_cpu["bytes_per_worker_per_step"]
