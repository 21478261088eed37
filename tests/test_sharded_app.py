"""The main job on sharded replicas, ``gossip-train --nproc 4 --shards 2``: one 4-worker run (2 replicas x 2 FSDP2
shards, Gloo on CPU, the default pipeline) and the flag combinations it refuses by name before any worker starts."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from helpers.launch import main_job_run, metrics_rows

from gossip.app.cli import main
from gossip.app.train import TrainConfig
from gossip.app.train_sharded import check_sharded
from gossip.errors import ConfigError

STEPS = 20
EVAL_EVERY = 10


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "4", "--shards", "2", "--steps", str(STEPS), "--batch-size", "4"]
    return main_job_run(tmp_path_factory.mktemp("sharded_job"), [*args, "--eval-every", str(EVAL_EVERY)])


def lane_losses(run_dir: Path, lane: int, replica: int) -> list[float]:
    """The training losses that lane ``lane``'s rank of replica ``replica`` logged, step by step."""
    folder = run_dir if lane == 0 else run_dir / f"lane{lane}"
    lines = (folder / f"metrics_rank{replica}.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.strip()]


@pytest.mark.multiprocess
def test_the_sharded_job_trains_two_replicas_with_the_default_pipeline(sharded_run):
    result, run_dir = sharded_run
    assert result.returncode == 0, result.stdout + result.stderr
    described = re.search(r"2 replica\(s\) x 2 shard\(s\), (.*), momentum-tracking-adamw,", result.stdout)
    assert described is not None, result.stdout
    assert described.group(1).startswith("powergossip on one_peer_hypercube") and "sign trackers" in described.group(1)
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["shards"], config["world_size"], config["algorithm"], config["gradient_tracking"]) == (
        2, 2, "powergossip", "sign"
    )  # fmt: skip
    rows = metrics_rows(run_dir)
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    losses = [float(row["mean_loss"]) for row in rows]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    assert [int(row["step"]) for row in rows if row["val_loss"]] == [EVAL_EVERY - 1, STEPS - 1]
    summary = json.loads((run_dir / "result.json").read_text())
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5


@pytest.mark.multiprocess
def test_the_shards_of_a_replica_train_on_the_same_batch_and_the_replicas_on_their_own(sharded_run):
    """Each replica's two shards compute the same loss at every step (one model, one batch); the replicas differ."""
    assert sharded_run[0].returncode == 0, sharded_run[0].stdout + sharded_run[0].stderr
    run_dir = sharded_run[1]
    for replica in (0, 1):
        assert lane_losses(run_dir, 0, replica) == lane_losses(run_dir, 1, replica)
        assert len(lane_losses(run_dir, 0, replica)) == STEPS
    assert lane_losses(run_dir, 0, 0) != lane_losses(run_dir, 0, 1)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--nproc", "3", "--shards", "2"], "--shards"),
        (["--nproc", "4", "--shards", "2", "--algorithm", "ddp"], "--algorithm"),
        (["--nproc", "4", "--shards", "2", "--algorithm", "diloco"], "--algorithm"),
        (["--nproc", "4", "--shards", "2", "--tracking-overlap"], "--tracking-overlap"),
        (["--nproc", "4", "--shards", "2", "--optimizer", "sgd"], "--optimizer"),
        (["--nproc", "4", "--shards", "2", "--average-every", "5"], "--average-every"),
        (["--nproc", "4", "--shards", "2", "--outer-every", "5"], "--outer-every"),
        (["--nproc", "4", "--shards", "2", "--elastic"], "--shards"),
    ],
)
def test_what_the_sharded_job_cannot_run_is_an_argparse_error_naming_the_option(capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {named}" in error, error


def test_check_sharded_counts_the_replicas_and_names_the_option():
    assert check_sharded(TrainConfig(algorithm="exact", shards=2), 8) == 4
    with pytest.raises(ConfigError, match="--backend"):
        check_sharded(TrainConfig(algorithm="exact", backend="mpi", shards=2), 4)
    with pytest.raises(ConfigError, match="--shards"):
        check_sharded(TrainConfig(algorithm="exact", shards=0), 4)
