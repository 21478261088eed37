"""``--gradient-tracking`` in the main job: parsed (off by default), refused with ``--algorithm ddp``, and a
2-process Gloo run whose every step sends the parameters' exact exchange plus the trackers' (one more model);
``--optimizer momentum-tracking-adamw``: refused without the trackers and with DDP, and a 2-process run that adds
the gradients' all-reduce every ``--second-moment-every`` steps."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from helpers.launch import completed_rows, main_job_run

from gossip.app.cli import build_parser, config_from
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import ConfigError, TrainConfig, resolve
from gossip.backends.base import ring_all_reduce_bytes

STEPS = 6


def test_the_option_is_off_by_default_and_turns_on():
    parser = build_parser()
    assert config_from(parser.parse_args([])).gradient_tracking is False
    assert config_from(parser.parse_args(["--gradient-tracking"])).gradient_tracking is True
    assert config_from(parser.parse_args(["--no-gradient-tracking"])).gradient_tracking is False


def test_ddp_refuses_gradient_tracking():
    with pytest.raises(ConfigError, match="--gradient-tracking") as caught:
        resolve(TrainConfig(algorithm="ddp", gradient_tracking=True), 2)
    assert caught.value.option == "--gradient-tracking"


@pytest.fixture(scope="module")
def tracking_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--steps", str(STEPS), "--algorithm", "exact", "--average-every", "0"]
    args += ["--gradient-tracking", "--batch-size", "4", "--eval-every", str(STEPS)]
    return main_job_run(tmp_path_factory.mktemp("tracking"), args)


@pytest.mark.multiprocess
def test_a_tracking_run_sends_the_parameters_and_the_trackers_every_step(tracking_run):
    rows = completed_rows(*tracking_run, STEPS)
    # 2 workers, one_peer_hypercube: one peer per step; exact gossip sends the model (float32) once, and the
    # tracker exchange sends one more model-sized message to the same peer
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    assert [int(row["bytes_sent"]) for row in rows] == [2 * model_bytes] * STEPS


def test_momentum_tracking_is_an_optimizer_that_needs_the_trackers():
    parser = build_parser()
    config = config_from(parser.parse_args(["--optimizer", "momentum-tracking-adamw", "--gradient-tracking"]))
    assert (config.optimizer, config.second_moment_every) == ("momentum-tracking-adamw", 32)
    assert config_from(parser.parse_args(["--second-moment-every", "0"])).second_moment_every == 0
    with pytest.raises(ConfigError, match="add --gradient-tracking") as caught:
        resolve(TrainConfig(optimizer="momentum-tracking-adamw", algorithm="exact"), 2)
    assert caught.value.option == "--optimizer"
    with pytest.raises(ConfigError, match="momentum-tracking-adamw is for gossip"):
        resolve(TrainConfig(optimizer="momentum-tracking-adamw", algorithm="ddp"), 2)


@pytest.fixture(scope="module")
def momentum_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--steps", str(STEPS), "--algorithm", "exact", "--average-every", "0"]
    args += ["--gradient-tracking", "--optimizer", "momentum-tracking-adamw", "--second-moment-every", "4"]
    args += ["--batch-size", "4", "--eval-every", str(STEPS)]
    return main_job_run(tmp_path_factory.mktemp("momentum"), args)


@pytest.mark.multiprocess
def test_a_momentum_tracking_run_all_reduces_the_gradients_every_k_steps(momentum_run):
    rows = completed_rows(*momentum_run, STEPS)
    # the parameters and the trackers every step, and at steps 0 and 4 the gradients' all-reduce (2 ranks: a ring
    # all-reduce sends the model once); the loss is finite
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    sample = ring_all_reduce_bytes(model_bytes, 2)
    expected = [2 * model_bytes + (sample if step % 4 == 0 else 0) for step in range(STEPS)]
    assert [int(row["bytes_sent"]) for row in rows] == expected
    assert all(math.isfinite(float(row["loss"])) for row in rows)
