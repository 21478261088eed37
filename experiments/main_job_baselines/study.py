"""The main job's defaults against ``--algorithm ddp`` and ``--algorithm diloco`` of the same command.

Every run is ``gossip-train --nproc N --batch-size B --steps T --seed S --out <work>/<method>-s<seed>`` plus the
method's options (none for the defaults), one after another; this script reads each run's ``result.json`` and
writes ``<results>/<csv>`` (one row per method and seed: final training loss, validation loss of the averaged model,
consensus distance, bytes sent per worker per step, training seconds) and prints, per method, the mean and spread
over seeds and the gap to the defaults paired by seed. Runs whose ``result.json`` exists are read, not rerun.

    python -m experiments.main_job_baselines --nproc 8 --batch-size 8 --steps 1000 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from experiments.shared import write_csv

RESULTS = Path(__file__).resolve().parent / "results"
#: method name -> the gossip-train options that select it (the defaults: none)
METHODS = {
    # since issue 59: PowerGossip, sign-compressed momentum trackers and momentum-tracking AdamW whose second moment
    # comes from the mean gradient averaged by gossip every 64 steps (gossip.Pipeline); no collective in the step
    "defaults": (),
    # the same with the trackers mixed twice a step (the default pipeline's from 9 to 16 workers)
    "defaults-two-hops": ("--tracker-hops", "2"),
    # the defaults from issue 27 to 59: PowerGossip every step and an exact average of the replicas every 10 steps
    # (an outer step, lr 1, no momentum), AdamW
    "hybrid": ("--outer-every", "10"),
    # that PowerGossip alone (the main job's defaults before issue 27)
    "no-outer-step": ("--outer-every", "0", "--optimizer", "adamw"),
    "ddp": ("--algorithm", "ddp"),
    "diloco": ("--algorithm", "diloco"),
    "diloco-h10-avg": ("--algorithm", "diloco", "--local-steps", "10", "--outer-lr", "1", "--outer-momentum", "0"),
    # momentum tracking (optim.MomentumTrackingAdamW, the mean gradient's second moment all-reduced every 32 steps),
    # one tracker hop a step: exact gossip and exact trackers, and the defaults' PowerGossip with exact trackers
    "exact-momentum-tracking": (
        "--algorithm", "exact", "--gradient-tracking", "--second-moment-every", "32", "--mean-gradient", "allreduce",
        "--tracker-hops", "1",
    ),
    "powergossip-momentum-tracking": (
        "--gradient-tracking", "--second-moment-every", "32", "--mean-gradient", "allreduce", "--tracker-hops", "1",
    ),
    # the one-hop defaults with the mean gradient all-reduced instead (the configuration of issue 27)
    "sign-momentum-tracking": ("--mean-gradient", "allreduce", "--tracker-hops", "1"),
}  # fmt: skip
COLUMNS = (
    "method",
    "seed",
    "final_train_loss",
    "final_val_loss",
    "consensus_distance",
    "bytes_sent_per_worker_per_step",
    "train_seconds",
)


def run_once(method: str, seed: int, args: argparse.Namespace) -> dict[str, object]:
    """Train ``method`` with ``seed`` (unless its result.json exists) and return its row."""
    out = args.work / f"{method}-s{seed}"
    if not (out / "result.json").exists():
        command = [sys.executable, "-m", "gossip", "--nproc", str(args.nproc), "--batch-size", str(args.batch_size)]
        command += ["--steps", str(args.steps), "--seed", str(seed), "--out", str(out), *METHODS[method]]
        print("gossip-train", *command[3:], flush=True)
        finished = subprocess.run(command, capture_output=True, text=True)
        if finished.returncode != 0:
            raise RuntimeError(f"{method} seed {seed} failed ({finished.returncode}):\n{finished.stderr[-2000:]}")
    result = json.loads((out / "result.json").read_text())
    return {"method": method, "seed": seed, **{key: result.get(key, "") for key in COLUMNS[2:]}}


def summary_lines(rows: list[dict[str, object]], column: str = "final_val_loss") -> list[str]:
    """Per method: mean ± sample standard deviation of ``column`` over seeds and the gap to the defaults, paired."""
    by_method: dict[str, dict[int, float]] = {}
    for row in rows:
        by_method.setdefault(str(row["method"]), {})[int(row["seed"])] = float(row[column])
    base = by_method.get("defaults", {})
    lines = []
    for method, values in by_method.items():
        seeds = sorted(values)
        spread = statistics.stdev(values.values()) if len(values) > 1 else 0.0
        line = f"{method:16s} {column} {statistics.mean(values.values()):.3f} ± {spread:.3f}"
        paired = [values[s] - base[s] for s in seeds if s in base]
        if method != "defaults" and paired:
            line += " | minus the defaults, seeds " + " / ".join(f"{gap:+.3f}" for gap in paired)
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    parser.add_argument("--work", type=Path, default=Path("runs/main_job_baselines"), help="run directories")
    parser.add_argument("--csv", default="summary.csv", help="file name under results/")
    args = parser.parse_args(argv)
    rows = [run_once(method, seed, args) for seed in args.seeds for method in args.methods]
    write_csv(RESULTS / args.csv, rows)
    for column in ("final_val_loss", "final_train_loss"):
        print("\n".join(summary_lines(rows, column)))
