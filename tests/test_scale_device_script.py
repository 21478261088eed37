"""experiments/scale/device_run.sh, what a session lent a GPU runs for the scale sweeps, run here on the CPU with
tiny runs (DEVICE=cpu): the runs named land seed by seed within the time given, none when there is no time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from experiments.shared import read_csv

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "scale" / "device_run.sh"
RUNS = ["smoke-n8-b2-ddp-s6-warmup2", "smoke-n8-b2-pipeline-s6-warmup2"]


def run_script(out: Path, total: int) -> subprocess.CompletedProcess:
    env = os.environ | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this interpreter's
        "OUT": str(out),
        "DEVICE": "cpu",
        "SWEEPS": "smoke",
        "ARGS": "--steps 6 --record-every 3",
        "SEEDS": "0 1",
        "RUNS": " ".join(RUNS),
        "TOTAL": str(total),
    }
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, cwd=SCRIPT.parents[2], capture_output=True, text=True, timeout=300
    )


def test_the_device_script_runs_the_named_runs_seed_by_seed(tmp_path):
    result = run_script(tmp_path, total=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runs: exit 0" in result.stdout
    landed = [(row["config"], row["seed"]) for row in read_csv(tmp_path / "summary.csv")]
    assert landed == [(RUNS[0], 0), (RUNS[1], 0), (RUNS[0], 1), (RUNS[1], 1)]
    assert {row["device"] for row in read_csv(tmp_path / "summary.csv")} == {"cpu"}


def test_the_device_script_starts_no_run_it_has_no_time_for(tmp_path):
    result = run_script(tmp_path, total=0)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (tmp_path / "summary.csv").exists()
    assert all(f"{name} seed 0: skipped, predicted" in result.stdout for name in RUNS), result.stdout
