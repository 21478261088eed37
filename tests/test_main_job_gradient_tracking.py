"""``--gradient-tracking`` in the main job: parsed (unset by default: the default pipeline's sign trackers, off
with an outer step or a periodic average), refused with ``--algorithm ddp``, and a 2-process Gloo run whose every
step sends the parameters' exact exchange plus the trackers' (one more model); ``--optimizer
momentum-tracking-adamw``: refused without the trackers and with DDP, and 2-process runs that add the mean gradient's
sample every ``--second-moment-every`` steps, all-reduced (``--mean-gradient allreduce``) or gossiped (one more
model to the step's peer, ``--mean-gradient gossip``). Tracking runs also compare the optimizers with the peers
(:func:`helpers.tracking_scenarios.comparison_bytes`)."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from helpers.launch import completed_rows, main_job_run
from helpers.tracking_scenarios import comparison_bytes

from gossip.app.cli import build_parser, config_from
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import ConfigError, TrainConfig, resolve
from gossip.backends.base import ring_all_reduce_bytes

STEPS = 6


def resolved(argv: list[str]) -> TrainConfig:
    return resolve(config_from(build_parser().parse_args(argv)), 4)[0]


def test_the_option_is_unset_by_default_and_turns_on_or_off():
    parser = build_parser()
    assert config_from(parser.parse_args([])).gradient_tracking is None
    assert config_from(parser.parse_args(["--gradient-tracking"])).gradient_tracking is True
    assert config_from(parser.parse_args(["--no-gradient-tracking"])).gradient_tracking is False


@pytest.mark.parametrize("argv", [[], ["--algorithm", "exact"], ["--outer-every", "0"]])
def test_gossip_alone_resolves_to_momentum_tracking_with_sign_trackers(argv):
    config = resolved(argv)
    assert (config.optimizer, config.gradient_tracking, config.outer_every) == ("momentum-tracking-adamw", "sign", 0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--outer-every", "10"],
        ["--average-every", "32"],
        ["--no-gradient-tracking"],
        ["--algorithm", "diloco"],
        ["--algorithm", "ddp"],
        ["--algorithm", "allreduce"],
    ],
)
def test_an_outer_step_a_periodic_average_no_tracking_or_another_algorithm_resolves_to_adamw_untracked(argv):
    config = resolved(argv)
    assert (config.optimizer, config.gradient_tracking) == ("adamw", False)


def test_given_trackers_or_optimizer_are_kept_and_the_other_resolves_to_match():
    assert resolved(["--gradient-tracking", "powergossip"]).optimizer == "momentum-tracking-adamw"
    assert resolved(["--outer-every", "10", "--gradient-tracking"]).optimizer == "adamw"
    assert resolved(["--optimizer", "adamw"]).gradient_tracking is False
    config = resolved(["--optimizer", "sgd", "--gradient-tracking", "sign"])
    assert (config.optimizer, config.gradient_tracking) == ("sgd", "sign")


def test_the_mean_gradient_is_gossiped_by_default_and_applies_to_momentum_tracking_only():
    assert config_from(build_parser().parse_args([])).mean_gradient is None
    assert resolved([]).mean_gradient == "gossip"
    assert resolved(["--mean-gradient", "allreduce"]).mean_gradient == "allreduce"
    with pytest.raises(ConfigError, match="applies to --optimizer momentum-tracking-adamw only, not adamw") as caught:
        resolved(["--outer-every", "10", "--mean-gradient", "allreduce"])
    assert caught.value.option == "--mean-gradient"


def test_the_sample_travels_in_bfloat16_by_default_and_the_dtype_applies_to_a_gossiped_sample_only():
    assert resolved([]).mean_gradient_dtype == "bfloat16"
    assert resolved(["--mean-gradient-dtype", "float32"]).mean_gradient_dtype == "float32"
    for argv, named in (
        (["--mean-gradient", "allreduce", "--mean-gradient-dtype", "float16"], "--mean-gradient allreduce"),
        (["--outer-every", "10", "--mean-gradient-dtype", "float16"], "--optimizer adamw"),
    ):
        with pytest.raises(ConfigError, match=f"applies to a gossiped sample .* only, not .*{named}") as caught:
            resolved(argv)
        assert caught.value.option == "--mean-gradient-dtype"
    with pytest.raises(ConfigError, match="unknown 'int8'") as caught:
        resolve(TrainConfig(mean_gradient_dtype="int8"), 2)
    assert caught.value.option == "--mean-gradient-dtype"


def test_ddp_refuses_gradient_tracking():
    with pytest.raises(ConfigError, match="--gradient-tracking") as caught:
        resolve(TrainConfig(algorithm="ddp", gradient_tracking=True), 2)
    assert caught.value.option == "--gradient-tracking"


@pytest.fixture(scope="module")
def tracking_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--steps", str(STEPS), "--algorithm", "exact", "--average-every", "0"]
    args += ["--gradient-tracking", "--optimizer", "adamw", "--batch-size", "4", "--eval-every", str(STEPS)]
    return main_job_run(tmp_path_factory.mktemp("tracking"), [*args, "--tracker-hops", "3"])


@pytest.mark.multiprocess
def test_a_tracking_run_sends_the_parameters_and_the_trackers_every_step(tracking_run):
    rows = completed_rows(*tracking_run, STEPS)
    # 2 workers, one_peer_hypercube: one peer per step; exact gossip sends the model (float32) once, and each of the
    # trackers' 3 hops (--tracker-hops 3) one more model-sized message to the same peer; the optimizers compared at
    # step 1
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    compared = comparison_bytes("one_peer_hypercube", 2, 0, STEPS)
    assert [int(row["bytes_sent"]) for row in rows] == [4 * model_bytes + c for c in compared]


def test_momentum_tracking_is_an_optimizer_that_needs_the_trackers():
    parser = build_parser()
    config = config_from(parser.parse_args(["--optimizer", "momentum-tracking-adamw", "--gradient-tracking"]))
    resolved, _ = resolve(config, 2)
    assert (resolved.optimizer, resolved.second_moment, resolved.second_moment_every) == (
        "momentum-tracking-adamw",
        "sample",
        64,
    )
    own, _ = resolve(config_from(parser.parse_args(["--second-moment-every", "0"])), 2)
    assert (own.second_moment, own.second_moment_every) == ("sample", 0)
    with pytest.raises(ConfigError, match="add --gradient-tracking") as caught:
        resolve(TrainConfig(optimizer="momentum-tracking-adamw", algorithm="exact", gradient_tracking=False), 2)
    assert caught.value.option == "--optimizer"
    with pytest.raises(ConfigError, match="momentum-tracking-adamw is for gossip"):
        resolve(TrainConfig(optimizer="momentum-tracking-adamw", algorithm="ddp"), 2)


def momentum_run(parent: Path, mean_gradient: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--steps", str(STEPS), "--algorithm", "exact", "--average-every", "0"]
    args += ["--gradient-tracking", "--optimizer", "momentum-tracking-adamw", "--second-moment-every", "4"]
    args += ["--mean-gradient", mean_gradient, "--batch-size", "4", "--eval-every", str(STEPS), *extra]
    return main_job_run(parent, args)


@pytest.mark.multiprocess
def test_a_momentum_tracking_run_all_reduces_the_gradients_every_k_steps(tmp_path):
    rows = completed_rows(*momentum_run(tmp_path, "allreduce"), STEPS)
    # the parameters and the trackers (one hop, the default at 2 workers) every step, and at steps 0 and 4 the
    # gradients' all-reduce (2 ranks: a ring all-reduce sends the model once); the optimizers compared at step 1; the
    # loss is finite
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    sample = ring_all_reduce_bytes(model_bytes, 2)
    compared = comparison_bytes("one_peer_hypercube", 2, 0, STEPS)
    expected = [2 * model_bytes + (sample if step % 4 == 0 else 0) + compared[step] for step in range(STEPS)]
    assert [int(row["bytes_sent"]) for row in rows] == expected
    assert all(math.isfinite(float(row["loss"])) for row in rows)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("dtype", "bytes_per_value"), [(None, 2), ("float32", 4)])
def test_a_momentum_tracking_run_gossips_each_sample_one_hop_to_the_next_steps_peer_and_no_collective(
    tmp_path, dtype, bytes_per_value
):
    extra = () if dtype is None else ("--mean-gradient-dtype", dtype)
    rows = completed_rows(*momentum_run(tmp_path, "gossip", *extra), STEPS)
    # the samples of steps 0 and 4 are averaged by one hop each (2 ranks: log2 2), at steps 1 and 5: one more model
    # to that step's peer (in bfloat16 by default), nothing all-reduced; every step the parameters and the trackers
    # (one hop at 2 workers); the optimizers compared at step 1
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    hop = model_bytes // 4 * bytes_per_value
    compared = comparison_bytes("one_peer_hypercube", 2, 0, STEPS)
    expected = [2 * model_bytes + (hop if step % 4 == 1 else 0) + compared[step] for step in range(STEPS)]
    assert [int(row["bytes_sent"]) for row in rows] == expected
    assert all(math.isfinite(float(row["loss"])) for row in rows)
