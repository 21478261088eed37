"""``--algorithm ddp``: the All-Reduce baseline (torch DistributedDataParallel) in the main job -- a 2-process Gloo
run, its metrics and traffic count, and the refusal of what it cannot run on."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.launch import metrics_rows, run_main_job

import gossip
from gossip.app.ddp_baseline import DDPBackendError, DDPBaseline
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import ConfigError, TrainConfig, resolve
from gossip.backends.base import ring_all_reduce_bytes

STEPS = 20
EVAL_EVERY, LOG_EVERY = 10, 5


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("ddp") / "run"
    args = ["--nproc", "2", "--algorithm", "ddp", "--steps", str(STEPS), "--batch-size", "4"]
    args += ["--eval-every", str(EVAL_EVERY), "--log-every", str(LOG_EVERY), "--out", str(out)]
    return run_main_job(args, out.parent), out


def test_ring_all_reduce_sends_two_n_minus_one_over_n_of_the_payload():
    assert ring_all_reduce_bytes(1000, 4) == 1500
    assert ring_all_reduce_bytes(1000, 2) == 1000
    assert ring_all_reduce_bytes(1000, 1) == 0


def test_ddp_with_the_mpi_backend_is_a_config_error_naming_backend():
    with pytest.raises(ConfigError) as error:
        resolve(TrainConfig(algorithm="ddp", backend="mpi"), 2)
    assert error.value.option == "--backend"


def test_ddp_with_a_schedule_is_a_config_error_naming_schedule():
    with pytest.raises(ConfigError) as error:
        resolve(TrainConfig(algorithm="ddp", schedule="ring"), 2)
    assert error.value.option == "--schedule"


def test_ddp_on_a_communicator_without_torch_distributed_is_refused_naming_backend():
    def build(comm: gossip.Communicator) -> str:
        with pytest.raises(DDPBackendError) as error:
            DDPBaseline(torch.nn.Linear(2, 2), comm)
        return str(error.value)

    messages = gossip.simulate(1, build)
    assert "--backend" in messages[0] and "rank 0" in messages[0]


@pytest.mark.multiprocess
def test_ddp_run_exits_zero(ddp_run):
    result, _ = ddp_run
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.multiprocess
def test_ddp_training_loss_falls(ddp_run):
    losses = [float(row["mean_loss"]) for row in metrics_rows(ddp_run[1])]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5


@pytest.mark.multiprocess
def test_ddp_replicas_are_identical_at_the_end(ddp_run):
    assert json.loads((ddp_run[1] / "result.json").read_text())["consensus_distance"] == 0.0


@pytest.mark.multiprocess
def test_ddp_consensus_is_zero_on_every_evaluated_step_and_estimated_there_only(ddp_run):
    estimated = {int(row["step"]): float(row["consensus"]) for row in metrics_rows(ddp_run[1]) if row["consensus"]}
    assert estimated == {step: 0.0 for step in range(EVAL_EVERY - 1, STEPS, EVAL_EVERY)}  # not every LOG_EVERY


@pytest.mark.multiprocess
def test_ddp_metrics_csv_has_every_step_with_timing_and_traffic(ddp_run):
    rows = metrics_rows(ddp_run[1])
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    for column in ("loss", "lr", "step_seconds", "compute_seconds", "wait_seconds", "bytes_sent"):
        assert all(row[column] != "" for row in rows), column


@pytest.mark.multiprocess
def test_ddp_bytes_per_step_are_a_ring_all_reduce_of_the_gradients(ddp_run):
    gradient_bytes = 4 * GPT(GPTConfig()).num_parameters()  # float32; the tied embedding counted once
    sent = {int(row["bytes_sent"]) for row in metrics_rows(ddp_run[1])}
    assert sent == {ring_all_reduce_bytes(gradient_bytes, 2)}


@pytest.mark.multiprocess
def test_ddp_config_json_records_the_algorithm_and_no_schedule(ddp_run):
    config = json.loads((ddp_run[1] / "config.json").read_text())
    assert config["algorithm"] == "ddp" and config["schedule"] is None
