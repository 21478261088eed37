"""The main job's mixing options ``--average-every`` (gossip.PeriodicAverage) and ``--power-iterations``: parsed,
carried in TrainConfig (so config.json), turned into the algorithm, and refused where they change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gossip
from gossip.app.cli import build_parser, config_from, main
from gossip.app.run_dir import describe_mixing
from gossip.app.train import DEFAULTS, ConfigError, TrainConfig, make_algorithm, resolve


def test_average_every_and_power_iterations_reach_the_config_and_its_json():
    args = build_parser().parse_args(["--algorithm", "powergossip", "--power-iterations", "3", "--average-every", "8"])
    config = config_from(args)
    assert (config.power_iterations, config.average_every) == (3, 8)
    assert config.to_json()["average_every"] == 8 and config.to_json()["power_iterations"] == 3


#: the fields of DEFAULTS that apply to a hybrid's outer step only: the defaults take none (``outer_every`` 0)
HYBRID_FIELDS = ("outer_lr", "outer_momentum")


def test_the_command_line_defaults_follow_the_one_place_that_sets_them():
    config, _ = resolve(config_from(build_parser().parse_args([])), 4)
    for field in dataclasses.fields(DEFAULTS):
        if field.name not in HYBRID_FIELDS:
            assert getattr(config, field.name) == getattr(DEFAULTS, field.name), field.name
    wrapped = isinstance(make_algorithm(config), gossip.PeriodicAverage)
    assert wrapped == (DEFAULTS.average_every > 0)


def test_the_second_moment_options_resolve_to_a_source_and_its_interval():
    config, _ = resolve(config_from(build_parser().parse_args(["--second-moment", "tracker"])), 4)
    assert (config.second_moment, config.second_moment_every) == ("tracker", 0)
    config, _ = resolve(config_from(build_parser().parse_args(["--second-moment", "sample"])), 4)
    assert (config.second_moment, config.second_moment_every) == ("sample", DEFAULTS.second_moment_every)
    config, _ = resolve(config_from(build_parser().parse_args(["--second-moment-every", "16"])), 4)
    assert (config.second_moment, config.second_moment_every) == ("sample", 16)


@pytest.mark.parametrize(
    ("argv", "option", "message"),
    [
        (["--second-moment", "tracker", "--second-moment-every", "16"], "--second-moment-every", "nothing to sample"),
        (["--second-moment", "tracker", "--optimizer", "adamw"], "--second-moment", "applies to --optimizer"),
    ],
)
def test_a_second_moment_option_that_changes_nothing_is_refused_by_name(argv, option, message):
    with pytest.raises(ConfigError, match=message) as error:
        resolve(config_from(build_parser().parse_args(argv)), 4)
    assert error.value.option == option


def test_a_hybrids_outer_step_takes_the_one_place_that_sets_it():
    assert DEFAULTS.outer_every == 0
    config, _ = resolve(config_from(build_parser().parse_args(["--outer-every", "10"])), 4)
    for name in HYBRID_FIELDS:
        assert getattr(config, name) == getattr(DEFAULTS, name), name


@pytest.mark.parametrize("algorithm", ["ddp", "allreduce", "exact"])
def test_unset_mixing_options_resolve_to_what_applies_so_a_changed_default_never_refuses_a_run(algorithm):
    config, _ = resolve(TrainConfig(algorithm=algorithm), 4)
    assert config.power_iterations == 1
    assert config.average_every == (0 if algorithm != "exact" else DEFAULTS.average_every)


def test_average_every_wraps_the_algorithm_with_its_settings():
    config, _ = resolve(
        TrainConfig(algorithm="powergossip", rank=4, power_iterations=2, message_dtype="float32", average_every=16), 4
    )
    algorithm = make_algorithm(config)
    assert isinstance(algorithm, gossip.PeriodicAverage) and algorithm.every == 16
    assert isinstance(algorithm.inner, gossip.PowerGossip)
    assert (algorithm.inner.matrix_rank, algorithm.inner.num_iterations) == (4, 2)
    assert describe_mixing(config) == (
        "powergossip on one_peer_hypercube (rank 4, 2 power iterations), exact average every 16 steps"
    )


def test_exact_gossip_with_periodic_averaging():
    config, _ = resolve(TrainConfig(algorithm="exact", average_every=4), 8)
    algorithm = make_algorithm(config)
    assert isinstance(algorithm, gossip.PeriodicAverage) and isinstance(algorithm.inner, gossip.ExactGossip)


@pytest.mark.parametrize(
    ("argv", "option", "says"),
    [
        (["--average-every", "-1"], "--average-every", "must be >= 0, got '-1'"),
        (["--average-every", "x"], "--average-every", "expected an int, got 'x'"),
        (["--algorithm", "ddp", "--average-every", "4"], "--average-every", "ddp averages every step already"),
        (["--algorithm", "allreduce", "--average-every", "4"], "--average-every", "allreduce averages every step"),
        (
            ["--algorithm", "exact", "--power-iterations", "2"],
            "--power-iterations",
            "applies to --algorithm powergossip only, not exact",
        ),
        (["--algorithm", "powergossip", "--power-iterations", "0"], "--power-iterations", "must be positive"),
    ],
)
def test_an_option_that_changes_nothing_or_is_out_of_range_is_an_argparse_error(capsys, argv, option, says):
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {option}" in error and says in error, error


@pytest.mark.parametrize("method", ["pg4-pga16-adamw", "pg4-pga16", "pg4-pga8-adamw", "pg1-pga16-adamw",
                                    "pg4-it4-pga16-adamw", "exact-pga16-adamw"])  # fmt: skip
def test_time_to_loss_periodic_average_methods_are_valid_main_job_commands(method):
    from experiments.time_to_loss.study import METHODS

    argv = METHODS[method].argv(100, 16, "out")
    assert argv[1:3] == ["-m", "gossip"]
    config, _ = resolve(config_from(build_parser().parse_args(argv[3:])), 8)
    algorithm = make_algorithm(config)
    assert isinstance(algorithm, gossip.PeriodicAverage)
    assert f"pga{algorithm.every}" in method
    assert (config.optimizer == "adamw") == method.endswith("-adamw")
    if method.startswith("pg"):
        assert method.startswith(f"pg{algorithm.inner.matrix_rank}-")
        assert ("-it4-" in method) == (algorithm.inner.num_iterations == 4)


def test_message_dtype_reaches_powergossip_and_is_refused_where_it_changes_nothing():
    config, _ = resolve(config_from(build_parser().parse_args(["--message-dtype", "bfloat16"])), 4)
    powergossip = make_algorithm(config)  # the defaults' algorithm, with no outer step around it
    assert type(powergossip) is gossip.PowerGossip
    assert powergossip.message_dtype is torch.bfloat16 and config.to_json()["message_dtype"] == "bfloat16"
    assert "bfloat16 messages" in describe_mixing(config)
    config, _ = resolve(TrainConfig(message_dtype="float32"), 4)
    assert make_algorithm(config).message_dtype is None  # the model's own float32
    config, _ = resolve(TrainConfig(message_dtype="bfloat16", outer_every=10), 4)
    assert make_algorithm(config).between.message_dtype is torch.bfloat16  # a hybrid's per-step PowerGossip
    with pytest.raises(ConfigError, match=r"--message-dtype.*applies to --algorithm powergossip only"):
        resolve(TrainConfig(algorithm="exact", message_dtype="float16"), 4)
    with pytest.raises(ConfigError, match=r"--message-dtype.*unknown 'int8'"):
        resolve(TrainConfig(message_dtype="int8"), 4)
