"""``--gradient-tracking`` in the main job: parsed (off by default), refused with ``--algorithm ddp``, and a
2-process Gloo run whose every step sends the parameters' exact exchange plus the trackers' (one more model)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers.launch import completed_rows, main_job_run

from gossip.app.cli import build_parser, config_from
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import ConfigError, TrainConfig, resolve

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
