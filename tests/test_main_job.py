"""The main job, ``python -m gossip`` / ``gossip-train``: a tiny end-to-end run on 2 local Gloo workers, its run
directory, and its handling of bad options and failed workers."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.launch import REPO, main_job_run, metrics_rows, run_main_job
from helpers.tracking_scenarios import comparison_bytes

from experiments.scale.sign import message_bytes
from gossip.app.cli import main
from gossip.app.corpus import load_corpus
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.run_dir import PLOTS

STEPS = 30


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--steps", str(STEPS), "--batch-size", "4", "--eval-every", "10", "--log-every", "3"]
    return main_job_run(tmp_path_factory.mktemp("job"), args)


@pytest.mark.multiprocess
def test_tiny_run_exits_zero_and_prints_summary_and_sample(tiny_run):
    result, _ = tiny_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "val loss (averaged model)" in result.stdout
    assert "sample from the averaged model" in result.stdout


@pytest.mark.multiprocess
def test_metrics_csv_has_one_row_per_step_in_order(tiny_run):
    rows = metrics_rows(tiny_run[1])
    assert [int(row["step"]) for row in rows] == list(range(STEPS))


@pytest.mark.multiprocess
def test_training_loss_is_finite_and_falls(tiny_run):
    losses = [float(row["mean_loss"]) for row in metrics_rows(tiny_run[1])]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5


@pytest.mark.multiprocess
def test_validation_loss_is_recorded_every_eval_every_steps(tiny_run):
    evaluated = [int(row["step"]) for row in metrics_rows(tiny_run[1]) if row["val_loss"]]
    assert evaluated == [9, 19, 29]


@pytest.mark.multiprocess
def test_consensus_is_estimated_with_each_evaluation_not_each_progress_update(tiny_run):
    estimated = [int(row["step"]) for row in metrics_rows(tiny_run[1]) if row["consensus"]]
    assert estimated == [9, 19, 29]


@pytest.mark.multiprocess
def test_the_defaults_send_the_same_light_step_but_half_a_model_more_for_the_gossiped_mean_gradient(tiny_run):
    """PowerGossip's products and the sign trackers' one message every step at 2 workers (3 bits a value and four
    float32 scales per 256 values), no collective; the mean gradient's sample of step 0 gossiped at step 1 (one hop
    on 2 workers: one more model, in bfloat16); the optimizers' comparison beside them."""
    numel = GPT(GPTConfig()).num_parameters()
    model_bytes = 4 * numel
    compared = comparison_bytes("one_peer_hypercube", 2, 0, STEPS)
    sent = [int(row["bytes_sent"]) - c for row, c in zip(metrics_rows(tiny_run[1]), compared, strict=True)]
    trackers = message_bytes(numel, 256, 4)  # at least: each bucket rounds up on its own
    assert trackers < sent[0] < trackers + model_bytes / 8
    assert sent == [sent[0] + (model_bytes // 2 if step == 1 else 0) for step in range(STEPS)]


@pytest.mark.multiprocess
def test_config_json_holds_the_resolved_values(tiny_run):
    config = json.loads((tiny_run[1] / "config.json").read_text())
    assert config["world_size"] == 2
    assert config["schedule"] == "one_peer_hypercube"
    assert config["accum_iter"] == 1  # max(1, 2 // 4)
    assert config["warmup_steps"] == STEPS // 10
    assert config["steps"] == STEPS and config["batch_size"] == 4
    assert (config["optimizer"], config["gradient_tracking"], config["mean_gradient"], config["outer_every"]) == (
        "momentum-tracking-adamw",
        "sign",
        "gossip",
        0,
    )
    assert config["tracker_hops"] == 1  # the default pipeline's at 2 workers
    assert config["out"] == str(tiny_run[1])


@pytest.mark.multiprocess
def test_every_rank_writes_its_metrics_and_rank0_writes_the_plots(tiny_run):
    out = tiny_run[1]
    for name in (*PLOTS, "metrics_rank0.jsonl", "metrics_rank1.jsonl", "result.json"):
        assert (out / name).stat().st_size > 0, name
    for rank in range(2):  # tensorboard is installed with the test extras
        assert any((out / "tensorboard" / f"rank{rank}").glob("events.out.tfevents.*")), rank


def test_unknown_algorithm_is_an_argparse_error_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--algorithm", "nope"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--algorithm" in error and "'nope'" in error


def test_schedule_the_algorithm_cannot_run_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "4", "--algorithm", "powergossip", "--schedule", "one_peer_exponential"])
    assert exit_info.value.code == 2
    assert "--schedule" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_failed_worker_fails_the_job_with_its_error(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 50)  # shorter than one window of block_size + 1 bytes
    result = run_main_job(["--nproc", "2", "--data", str(tiny), "--out", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 1
    assert "worker rank" in result.stderr and "block_size + 1" in result.stderr


def test_ddp_with_the_mpi_backend_is_an_argparse_error_naming_backend(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", "--algorithm", "ddp", "--backend", "mpi"])
    assert exit_info.value.code == 2
    assert "--backend" in capsys.readouterr().err


def test_ddp_with_a_schedule_is_an_argparse_error_naming_schedule(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", "--algorithm", "ddp", "--schedule", "ring"])
    assert exit_info.value.code == 2
    assert "--schedule" in capsys.readouterr().err


def test_empty_data_file_is_an_argparse_error_naming_data(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", "--data", str(empty)])
    assert exit_info.value.code == 2
    assert f"argument --data: '{empty}' is empty; give a text file to train on" in capsys.readouterr().err


def test_empty_data_file_read_by_a_worker_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"--data file '.*empty.txt' is empty; give a text file to train on"):
        load_corpus(str(empty))


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_timeout_that_is_not_positive_and_finite_is_an_argparse_error(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["--timeout", value])
    assert exit_info.value.code == 2
    assert f"argument --timeout: must be positive and finite, got '{value}'" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def _training(tmp_path: Path, nproc: int, until_rank: int) -> Iterator[subprocess.Popen]:
    """``gossip-train --nproc nproc`` (a long run) once rank ``until_rank`` has logged a step; killed at exit if
    still running."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "gossip", "--nproc", str(nproc), "--steps", "100000", "--batch-size", "2"]
    launcher = subprocess.Popen(
        [*command, "--out", str(out)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / f"metrics_rank{until_rank}.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()
            time.sleep(0.2)
        yield launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_stops_and_reaps_every_worker(tmp_path):
    with _training(tmp_path, nproc=2, until_rank=1) as launcher:
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.send_signal(signal.SIGTERM)
        stderr = launcher.communicate(timeout=60)[1]
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "gossip-train: SIGTERM received; workers stopped" in stderr
    assert not [pid for pid in workers if _alive(pid)]


def _rank_of(pid: int) -> int | None:
    """The RANK the launcher gave worker ``pid`` (from its environment), or None once it is gone."""
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [entry.split(b"=", 1)[1] for entry in environment if entry.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


@pytest.mark.multiprocess
def test_a_sigkilled_worker_is_the_one_the_launcher_names(tmp_path):
    """Its peers fail too (they lose it, then the launcher stops them): the report must name the killed rank."""
    with _training(tmp_path, nproc=4, until_rank=2) as launcher:
        victim = [pid for pid in _children(launcher.pid) if _rank_of(pid) == 2]
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        stderr = launcher.communicate(timeout=60)[1]
    assert launcher.returncode == 1, stderr
    assert "gossip-train: worker rank 2 of 4 killed by SIGKILL" in stderr, stderr


def test_the_launcher_blames_a_failed_worker_over_those_that_lost_it(tmp_path):
    from gossip.app.local_launch import exit_description, root_cause

    for rank in (0, 1, 3):
        (tmp_path / f"rank{rank}.txt").write_text(f"PeerFailedError: step 7: rank {rank}: peer 2 failed")
    assert root_cause({0: 1, 1: 1, 2: -signal.SIGKILL, 3: 1}, tmp_path) == (2, "(see its output above)")
    assert exit_description(-signal.SIGKILL) == "killed by SIGKILL" and exit_description(3) == "exited with status 3"
    (tmp_path / "rank2.txt").write_text("ValueError: bad batch")
    assert root_cause({0: 1, 2: 1}, tmp_path) == (2, "ValueError: bad batch")
