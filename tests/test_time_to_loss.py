"""The time-to-loss benchmark's analysis: smoothing, first crossing, ratios to DDP, run reading, step budgets."""

from __future__ import annotations

import csv
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from experiments.time_to_loss.study import (
    BASELINE,
    CLOCK_START_STEP,
    METHODS,
    BenchmarkError,
    Curve,
    across_seeds,
    compare,
    final_loss,
    finished_runs,
    main,
    plot_name,
    read_curve,
    smoothed,
    step_budget,
    time_to_target,
)

losses_strategy = st.lists(st.floats(0.0, 10.0), min_size=1, max_size=40)


def curve(method: str, losses, seconds_per_step: float) -> Curve:
    losses = np.asarray(losses, dtype=float)
    return Curve(method, losses, seconds_per_step * np.arange(len(losses)), seconds_per_step, math.nan, 0.0)


@given(losses_strategy, st.integers(1, 12))
def test_smoothed_is_the_trailing_mean(losses, window):
    got = smoothed(losses, window)
    want = [np.mean(losses[max(0, t - window + 1) : t + 1]) for t in range(len(losses))]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@given(losses_strategy, st.floats(0.0, 10.0))
def test_time_to_target_is_the_first_step_whose_smoothed_loss_reaches_it(losses, target):
    seconds = np.arange(len(losses)) * 0.5
    step, at = time_to_target(losses, seconds, target, window=3)
    below = [t for t, value in enumerate(smoothed(losses, 3)) if value <= target]
    if below:
        assert (step, at) == (below[0], seconds[below[0]])
    else:
        assert step is None and math.isnan(at)


def test_final_loss_is_the_mean_of_the_last_window():
    assert final_loss(list(range(20)), window=10) == pytest.approx(14.5)
    with pytest.raises(BenchmarkError, match="empty"):
        final_loss([])


@given(losses_strategy)
def test_every_curve_reaches_its_own_final_loss(losses):
    step, _ = time_to_target(losses, np.arange(len(losses)), final_loss(losses))
    assert step is not None


def test_time_to_target_refuses_mismatched_lengths():
    with pytest.raises(BenchmarkError, match="3 losses but 2 times"):
        time_to_target([1.0, 2.0, 3.0], [0.0, 1.0], 1.0)


def test_same_losses_at_twice_the_step_time_take_twice_as_long():
    losses = np.linspace(5.0, 1.0, 50)
    rows = {row["method"]: row for row in compare([curve(BASELINE, losses, 0.2), curve("exact", losses, 0.4)])}
    assert rows[BASELINE]["ratio_to_ddp"] == 1.0 and rows[BASELINE]["loss_gap"] == 0.0
    assert rows["exact"]["ratio_to_ddp"] == pytest.approx(2.0)
    assert rows["exact"]["common_ratio_to_ddp"] == pytest.approx(2.0)


def test_a_method_that_never_reaches_ddps_loss_gets_no_ratio_but_a_common_loss():
    ddp = curve(BASELINE, np.linspace(5.0, 1.0, 50), 0.2)
    gossip = curve("exact", np.linspace(5.0, 2.0, 50), 0.1)
    rows = {row["method"]: row for row in compare([ddp, gossip])}
    assert math.isnan(rows["exact"]["ratio_to_ddp"]) and rows["exact"]["step_to_target"] is None
    assert rows["exact"]["loss_gap"] == pytest.approx(final_loss(gossip.losses) - final_loss(ddp.losses))
    assert rows["exact"]["common_loss"] == pytest.approx(final_loss(gossip.losses))  # the worse final loss
    assert rows["exact"]["common_ratio_to_ddp"] < 1.0  # faster per step to the loss both reach


def test_compare_needs_the_baseline():
    with pytest.raises(BenchmarkError, match="no 'ddp' run"):
        compare([curve("exact", [1.0, 0.5], 0.1)])


def test_read_curve_starts_the_clock_after_the_set_up_steps(tmp_path):
    fields = ["step", "mean_loss", "elapsed_seconds", "step_seconds", "bytes_sent", "val_loss"]
    rows = [[t, 5.0 - t, 10.0 + 0.5 * t + (3.0 if t == 0 else 0.0), 0.5, 100, ""] for t in range(6)]
    rows[-1][-1] = "1.25"
    with open(tmp_path / "metrics.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(fields)
        writer.writerows(rows)
    got = read_curve("exact", tmp_path)
    assert got.seconds[CLOCK_START_STEP] == 0.0
    np.testing.assert_allclose(np.diff(got.seconds[CLOCK_START_STEP:]), 0.5)
    assert (got.final_val_loss, got.bytes_per_step, got.mean_step_seconds) == (1.25, 100.0, 0.5)


def test_read_curve_names_a_run_without_metrics(tmp_path):
    with pytest.raises(BenchmarkError, match=r"pg4: no metrics\.csv"):
        read_curve("pg4", tmp_path)


def test_gossip_steps_apply_to_every_method_but_ddp():
    assert step_budget(BASELINE, 300, 900) == 300
    assert step_budget("exact-adamw", 300, 900) == 900
    assert step_budget("exact-adamw", 300, None) == 300


def test_the_command_line_requires_ddp_and_known_methods(capsys):
    with pytest.raises(SystemExit):
        main(["--methods", "exact", "--from-runs", "."])
    assert "'ddp' is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--methods", "ddp", "nonsense", "--from-runs", "."])
    assert "unknown ['nonsense']" in capsys.readouterr().err


def test_plots_are_named_by_configuration_and_seed():
    names = {plot_name(csv_name, rate, seed) for csv_name in ("a.csv", "b.csv") for rate in ("1gbit", "100mbit")
             for seed in (0, 1)}  # fmt: skip
    assert len(names) == 8
    assert plot_name("fp16_budget600.csv", "100mbit", seed=0) == "fp16_budget600_100mbit_s0.png"
    assert plot_name("a.csv", "1gbit", 2, repeat=1) == "a_1gbit_s2_r1.png" != plot_name("a.csv", "1gbit", 2)


@pytest.mark.parametrize("method", ["ddp", "pg4-it2-adamw", "decentdp"])
def test_every_method_trains_with_the_seed_it_is_given(method):
    argv = METHODS[method].argv(300, 8, "out", 2)
    assert argv[argv.index("--seed") + 1] == "2"


def test_the_gossiped_sample_and_its_float32_twin_differ_only_in_the_samples_dtype():
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import resolve

    def resolved(method: str) -> dict:
        argv = METHODS[method].argv(300, 8, "out", 0)[3:]
        return vars(resolve(config_from(build_parser().parse_args(argv)), 8)[0])

    default, twin = resolved("pg4-it2-fp16-mtsign-gossipv-adamw"), resolved("pg4-it2-fp16-mtsign-gossipv32-adamw")
    assert (default["mean_gradient_dtype"], twin["mean_gradient_dtype"]) == ("bfloat16", "float32")
    assert {key for key in default if default[key] != twin[key]} == {"mean_gradient_dtype"}


def test_the_one_and_three_hop_methods_are_the_main_jobs_default_at_8_and_at_16_workers():
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import resolve

    def resolved(argv: list[str], n: int) -> dict:
        return vars(resolve(config_from(build_parser().parse_args(argv)), n)[0])

    mixing = ("algorithm", "rank", "power_iterations", "message_dtype", "gradient_tracking", "tracker_hops",
              "optimizer", "second_moment", "second_moment_every", "mean_gradient", "mean_gradient_dtype")  # fmt: skip
    for method, n, hops in (("pg4-it2-fp16-mtsign-gossipv-adamw", 8, 1), ("pg4-it2-fp16-mtsign3-gossipv-adamw", 16, 3)):
        argv = METHODS[method].argv(300, 8, "out", 0)
        given = resolved(argv[3:], n)
        plain = resolved(argv[argv.index("--steps") :], n)  # the run's length, batch, seed and out only: the defaults
        assert given["tracker_hops"] == hops
        assert {key: given[key] for key in mixing} == {key: plain[key] for key in mixing}, method


def test_finished_runs_read_the_seed_from_the_name_and_seed_0_from_runs_named_before_seeds(tmp_path):
    for name in ("20261122-100000-1gbit-r0-ddp", "20261122-110000-100mbit-r1-s2-pg4-it2-adamw", "notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_text("step\n")
    groups = finished_runs(tmp_path)
    assert groups == {
        ("20261122-100000", "1gbit", 0, 0): [("ddp", tmp_path / "20261122-100000-1gbit-r0-ddp")],
        ("20261122-110000", "100mbit", 1, 2): [
            ("pg4-it2-adamw", tmp_path / "20261122-110000-100mbit-r1-s2-pg4-it2-adamw")
        ],
    }


def test_across_seeds_gives_the_mean_and_sample_spread_of_the_ratios_and_counts_runs_that_miss_the_target():
    def row(seed, method, ratio, gap, sent):
        return {"rate": "1gbit", "seed": seed, "method": method, "ratio_to_ddp": ratio, "loss_gap": gap,
                "final_train_loss": 2.0 + gap, "mean_step_ms": 100.0, "bytes_per_step": sent}  # fmt: skip

    table = [row(s, BASELINE, 1.0, 0.0, 3000.0) for s in range(3)]
    table += [row(0, "exact", 0.5, 0.1, 100.0), row(1, "exact", 0.7, 0.3, 100.0), row(2, "exact", math.nan, 0.5, 100.0)]
    got = {r["method"]: r for r in across_seeds(table)}
    assert got["exact"]["runs"] == 3 and got["exact"]["seeds"] == "0 1 2"
    assert got["exact"]["runs_reaching_target"] == 2
    assert got["exact"]["ratio_to_ddp_mean"] == pytest.approx(0.6)
    assert got["exact"]["ratio_to_ddp_std"] == pytest.approx(math.sqrt(0.02))
    assert got["exact"]["loss_gap_mean"] == pytest.approx(0.3) and got["exact"]["loss_gap_std"] == pytest.approx(0.2)
    assert got["exact"]["bytes_vs_ddp"] == pytest.approx(1 / 30)
    assert got[BASELINE]["ratio_to_ddp_std"] == 0.0


def test_every_powergossip_method_names_its_settings_so_a_changed_default_leaves_it_as_labelled():
    for method in METHODS.values():
        argv = method.argv(300, 8, "out", 0)
        if "powergossip" in argv:
            for option in ("--rank", "--power-iterations", "--message-dtype", "--optimizer"):
                assert option in argv, (method.name, option)
            dtype = argv[argv.index("--message-dtype") + 1]
            assert ("fp16" in method.name) == (dtype == "float16"), method.name


def test_every_gossip_method_names_its_outer_step_so_the_defaults_average_stays_out_where_not_named():
    """Every exact or PowerGossip method says whether it takes an outer step (only the hybrid ``-h10-avg-`` does,
    the main job's defaults from issue 27 to 59), and resolves to it whatever the defaults are."""
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import resolve

    gossiping = 0
    for method in METHODS.values():
        argv = method.argv(300, 8, "out", 0)
        if "exact" not in argv and "powergossip" not in argv:
            continue
        gossiping += 1
        assert "--outer-every" in argv, method.name
        config, _ = resolve(config_from(build_parser().parse_args(argv[3:])), 8)
        assert config.outer_every == (10 if re.search(r"-h10(-d\d+)?-avg-", method.name) else 0), method.name
    assert gossiping >= 15


def test_allreduce_vs_gossip_runs_gossip_alone():
    from experiments.allreduce_vs_gossip.study import Run
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import resolve

    for algorithm in ("exact", "powergossip"):
        argv = Run(algorithm, "ring", 4 if algorithm == "powergossip" else 0, "iid").arguments()
        assert resolve(config_from(build_parser().parse_args(argv)), 4)[0].outer_every == 0, algorithm


@pytest.mark.parametrize("method", ["diloco-h20-adamw", "diloco-h50-adamw"])
def test_diloco_methods_are_main_job_commands_that_name_every_setting(method):
    """The DiLoCo baselines run ``gossip-train --algorithm diloco`` with H as named, the paper's outer SGD and
    AdamW, each setting on the command line so that a changed default leaves the method as labelled."""
    import gossip
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import make_algorithm, resolve

    argv = METHODS[method].argv(300, 8, "out", 1)
    for option in ("--local-steps", "--outer-lr", "--outer-momentum", "--optimizer", "--seed"):
        assert option in argv, option
    config, _ = resolve(config_from(build_parser().parse_args(argv[3:])), 8)
    algorithm = make_algorithm(config)
    assert isinstance(algorithm, gossip.DiLoCo) and config.optimizer == "adamw" and config.seed == 1
    assert method == f"diloco-h{algorithm.local_steps}-adamw"
    assert (algorithm.outer_lr, algorithm.outer_momentum, algorithm.nesterov) == (0.7, 0.9, True)


@pytest.mark.parametrize(("method", "delay", "merge"), [("pg4-it2-fp16-h10-avg-adamw", 0, None),
                                                      ("pg4-it2-fp16-h10-d1-avg-adamw", 1, 0.5)])  # fmt: skip
def test_the_hybrid_is_the_main_jobs_powergossip_with_a_plain_average_every_h_steps(method, delay, merge):
    """``pg4-it2-fp16-h10-avg-adamw`` keeps the defaults' PowerGossip every step (as the study's hybrid) and takes an
    outer step at lr 1 without momentum, all-reduced, every 10 steps, each setting on the command line; its ``-d1``
    twin lands each average a step late and merges halfway."""
    import gossip
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import make_algorithm, resolve

    argv = METHODS[method].argv(300, 8, "out", 1)
    config, _ = resolve(config_from(build_parser().parse_args(argv[3:])), 8)
    algorithm = make_algorithm(config)
    assert isinstance(algorithm, gossip.OuterOptimizer) and not isinstance(algorithm, gossip.DiLoCo)
    assert isinstance(algorithm.averaging, gossip.AllReduce) and algorithm.local_steps == 10
    assert (algorithm.outer_lr, algorithm.outer_momentum) == (1.0, 0.0)
    assert algorithm.delay == delay and (merge is None or algorithm.merge == merge)
    between = algorithm.between
    assert isinstance(between, gossip.PowerGossip) and between.matrix_rank == 4 and between.num_iterations == 2
    assert between.message_dtype == torch.float16 and config.optimizer == "adamw" and config.seed == 1


@pytest.mark.parametrize(("method", "parameters"), [("exact-mt-adamw", "exact"),
                                                    ("pg4-it2-fp16-mt-adamw", "powergossip")])  # fmt: skip
def test_momentum_tracking_methods_run_the_optimizer_on_exact_trackers(method, parameters):
    """The momentum-tracking methods mix the parameters as named, track with exact trackers, step with
    MomentumTrackingAdamW sampling the mean gradient's second moment every 32 steps, and take no outer step."""
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import resolve

    argv = METHODS[method].argv(300, 8, "out", 1)
    config, _ = resolve(config_from(build_parser().parse_args(argv[3:])), 8)
    assert config.algorithm == parameters and config.outer_every == 0 and config.seed == 1
    assert config.gradient_tracking == "exact" and config.optimizer == "momentum-tracking-adamw"
    assert config.second_moment_every == 32
