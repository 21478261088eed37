"""The main job's outer-optimizer options (``--outer-sync``, ``--outer-every``, ``--outer-delay``, ``--outer-merge``):
parsed, resolved and turned into gossip.OuterOptimizer (plain ``--algorithm diloco`` stays gossip.DiLoCo), refused
where they change nothing or are out of range, listed by ``--help``; and a 2-process Gloo run of a delayed hybrid
that exits 0 and learns."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from helpers.launch import completed_rows, main_job_run

import gossip
from gossip.app.cli import build_parser, config_from, main
from gossip.app.run_dir import describe_mixing
from gossip.app.train import TrainConfig, make_algorithm, resolve


def built(argv: list[str], workers: int = 4) -> tuple[TrainConfig, gossip.Algorithm]:
    config, _ = resolve(config_from(build_parser().parse_args(argv)), workers)
    return config, make_algorithm(config)


def test_plain_diloco_is_still_gossip_diloco_and_records_allreduce():
    config, algorithm = built(["--algorithm", "diloco"])
    assert type(algorithm) is gossip.DiLoCo
    assert (config.outer_sync, config.outer_every, config.outer_delay, config.outer_merge) == ("allreduce", 0, 0, None)


def test_the_defaults_take_no_outer_step_and_track_the_first_moments_with_signs():
    config, algorithm = built([])
    assert type(algorithm) is gossip.PowerGossip and config.outer_every == 0
    assert (algorithm.matrix_rank, algorithm.num_iterations, algorithm.message_dtype) == (4, 2, torch.float16)
    assert (config.optimizer, config.gradient_tracking) == ("momentum-tracking-adamw", "sign")
    assert "outer" not in describe_mixing(config)
    _, exact = built(["--algorithm", "exact"])
    assert type(exact) is gossip.ExactGossip
    for other in ("ddp", "allreduce", "diloco"):
        assert resolve(TrainConfig(algorithm=other), 4)[0].outer_every == 0, other


def test_outer_every_10_is_powergossip_every_step_and_an_exact_average_every_10_steps():
    config, algorithm = built(["--outer-every", "10"])
    assert type(algorithm) is gossip.OuterOptimizer and isinstance(algorithm.averaging, gossip.AllReduce)
    assert (algorithm.local_steps, algorithm.outer_lr, algorithm.outer_momentum, algorithm.delay) == (10, 1.0, 0.0, 0)
    between = algorithm.between
    assert type(between) is gossip.PowerGossip
    assert (between.matrix_rank, between.num_iterations, between.message_dtype) == (4, 2, torch.float16)
    assert (config.optimizer, config.gradient_tracking) == ("adamw", False)
    assert describe_mixing(config).endswith("exact average every 10 steps (outer step, lr 1, no momentum)")
    _, exact = built(["--algorithm", "exact", "--outer-every", "10"])
    assert type(exact) is gossip.OuterOptimizer and type(exact.between) is gossip.ExactGossip
    # landing late, the replica merges with the average instead of becoming it: not called an exact average
    delayed, _ = built(["--outer-every", "10", "--outer-delay", "1"])
    assert describe_mixing(delayed).endswith(
        "outer Nesterov SGD lr 1 momentum 0 every 10 steps, landing 1 step(s) late (merge 0.5)"
    )
    _, gossiped = built(["--outer-every", "10", "--outer-sync", "gossip", "--outer-lr", "0.8"])
    assert isinstance(gossiped.averaging, gossip.ExactGossip) and (gossiped.local_steps, gossiped.outer_lr) == (10, 0.8)


def test_average_every_replaces_the_mixing_every_k_steps_with_adamw_and_no_note():
    config, notes = resolve(config_from(build_parser().parse_args(["--average-every", "32"])), 4)
    assert (config.average_every, config.outer_every) == (32, 0)
    assert isinstance(make_algorithm(config), gossip.PeriodicAverage)
    assert (config.optimizer, config.gradient_tracking) == ("adamw", False)
    assert notes == []


def test_diloco_with_gossip_averaged_pseudo_gradients():
    config, algorithm = built(["--algorithm", "diloco", "--local-steps", "10", "--outer-sync", "gossip"])
    assert type(algorithm) is gossip.OuterOptimizer
    assert isinstance(algorithm.averaging, gossip.ExactGossip) and algorithm.between is None
    assert (algorithm.local_steps, algorithm.outer_lr, algorithm.outer_momentum) == (10, 0.7, 0.9)
    assert describe_mixing(config) == (
        "diloco (outer Nesterov SGD lr 0.7 momentum 0.9 every 10 steps on gossip-averaged pseudo-gradients) "
        "on one_peer_hypercube"
    )


def test_a_delayed_powergossip_hybrid():
    argv = ["--algorithm", "powergossip", "--outer-every", "50", "--outer-sync", "powergossip", "--outer-delay", "2"]
    config, algorithm = built([*argv, "--outer-lr", "0.5"])
    assert type(algorithm) is gossip.OuterOptimizer
    assert isinstance(algorithm.between, gossip.PowerGossip) and algorithm.between.matrix_rank == config.rank
    assert isinstance(algorithm.averaging, gossip.PowerGossip) and algorithm.averaging.num_iterations == 1
    assert (algorithm.local_steps, algorithm.delay, algorithm.merge, algorithm.outer_lr) == (50, 2, 0.5, 0.5)
    assert algorithm.outer_momentum == 0.0  # a hybrid's own default, not DiLoCo's 0.9
    assert config.local_steps is None  # a hybrid's period is --outer-every
    assert describe_mixing(config).endswith(
        "outer Nesterov SGD lr 0.5 momentum 0 every 50 steps on powergossip-averaged pseudo-gradients, landing 2 "
        "step(s) late (merge 0.5)"
    )


def test_streaming_diloco_with_an_all_reduce_and_an_explicit_merge():
    _, algorithm = built(["--algorithm", "diloco", "--outer-delay", "1", "--outer-merge", "0"])
    assert type(algorithm) is gossip.OuterOptimizer and isinstance(algorithm.averaging, gossip.AllReduce)
    assert (algorithm.delay, algorithm.merge) == (1, 0.0)


def test_help_lists_the_outer_options():
    text = build_parser().format_help()
    for option in ("--outer-sync {allreduce,gossip,powergossip}", "--outer-every H", "--outer-delay TAU"):
        assert option in text
    assert "Streaming DiLoCo's tau" in text and "theta + a (x - theta)" in text


@pytest.mark.parametrize(
    ("argv", "option", "says"),
    [
        (["--outer-every", "0", "--outer-sync", "gossip"], "--outer-sync", "diloco or --outer-every only"),
        (["--outer-lr", "0.8"], "--outer-lr", "--outer-every only, not powergossip"),  # the defaults take no outer step
        (["--algorithm", "ddp", "--outer-delay", "1"], "--outer-delay", "diloco or --outer-every only, not ddp"),
        (["--algorithm", "diloco", "--outer-every", "5"], "--outer-every", "a hybrid runs --algorithm exact or"),
        (["--algorithm", "allreduce", "--outer-every", "5"], "--outer-every", "not allreduce"),
        (["--algorithm", "diloco", "--outer-merge", "0.5"], "--outer-merge", "applies with --outer-delay only"),
        (["--algorithm", "diloco", "--local-steps", "4", "--outer-delay", "4"], "--outer-delay", "below the 4 steps"),
        (["--outer-every", "8", "--average-every", "4"], "--average-every", "--outer-every takes an outer step"),
        (["--algorithm", "diloco", "--outer-merge", "1.5"], "--outer-merge", "must be in [0, 1]"),
        (["--outer-every", "-1"], "--outer-every", "must be >= 0"),
        (["--algorithm", "diloco", "--outer-sync", "ring"], "--outer-sync", "invalid choice"),
        (["--algorithm", "exact", "--local-steps", "4", "--outer-every", "8"], "--local-steps", "diloco only"),
    ],
)
def test_an_outer_option_out_of_range_or_where_it_changes_nothing_is_an_argparse_error(capsys, argv, option, says):
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {option}" in error and says in error, error


STEPS, EVERY = 6, 3


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--algorithm", "exact", "--outer-every", str(EVERY), "--outer-sync", "gossip"]
    args += ["--outer-delay", "1", "--steps", str(STEPS), "--batch-size", "4", "--eval-every", "3"]
    return main_job_run(tmp_path_factory.mktemp("outer"), args)


@pytest.mark.multiprocess
def test_a_short_delayed_hybrid_run_exits_zero_learns_and_sends_every_step(hybrid_run):
    result, out = hybrid_run
    rows = completed_rows(result, out, STEPS)
    assert "every 3 steps on gossip-averaged pseudo-gradients, landing 1 step(s) late (merge 0.5)" in result.stdout
    losses = [float(row["mean_loss"]) for row in rows]
    assert losses[-1] < losses[0]
    assert all(int(row["bytes_sent"]) > 0 for row in rows)  # exact gossip between, the pseudo-gradients on 2 and 5
