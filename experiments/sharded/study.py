"""The main job on sharded replicas (``--shards 2``) against the unsharded job of the same replicas, seed by seed.

Every run is ``gossip-train --batch-size B --steps T --eval-every E --seed S --out <work>/<method>-s<seed>`` plus
the method's options, one after another: ``sharded`` is R replicas x 2 FSDP2 shards (``--nproc 2R --shards 2``:
the default pipeline, PowerGossip in block mode), ``unsharded`` the same R replicas one process each (the default
pipeline); ``sharded-exact`` and ``unsharded-exact`` the same with exact gossip and AdamW, no trackers. The
script reads each run's ``result.json`` and ``metrics.csv`` and writes ``<results>/<csv>``: one row per method
and seed (final training loss, validation loss of the averaged model, consensus distance, bytes per worker per
step, training seconds) and, for the sharded rows, the largest gap to its unsharded twin of the same seed over
every step's mean training loss and every evaluation. It prints the mean and spread over seeds per method. Runs
whose ``result.json`` exists are read, not rerun.

    python -m experiments.sharded --replicas 2 --steps 300 --seeds 0 1 2            # both pairs
    python -m experiments.sharded --methods sharded --csv pipeline.csv                 # the default pipeline only
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

from experiments.shared import write_csv

RESULTS = Path(__file__).resolve().parent / "results"
SHARDS = 2
_EXACT = ("--algorithm", "exact", "--optimizer", "adamw", "--no-gradient-tracking")
#: method name -> the gossip-train options that select it, given R replicas; each sharded method has an unsharded
#: twin of the same options (its name without "sharded-" / with "unsharded")
METHODS = {
    "unsharded": lambda replicas: ("--nproc", str(replicas)),  # the default pipeline
    "sharded": lambda replicas: ("--nproc", str(replicas * SHARDS), "--shards", str(SHARDS)),
    "unsharded-exact": lambda replicas: ("--nproc", str(replicas), *_EXACT),
    "sharded-exact": lambda replicas: ("--nproc", str(replicas * SHARDS), "--shards", str(SHARDS), *_EXACT),
}
#: each sharded method's unsharded twin
TWINS = {"sharded": "unsharded", "sharded-exact": "unsharded-exact"}
COLUMNS = (
    "final_train_loss",
    "final_val_loss",
    "consensus_distance",
    "bytes_sent_per_worker_per_step",
    "train_seconds",
)


def run_once(method: str, seed: int, args: argparse.Namespace) -> Path:
    """Train ``method`` with ``seed`` (unless its result.json exists); return its run directory."""
    out = args.work / f"{method}-s{seed}"
    if not (out / "result.json").exists():
        command = [sys.executable, "-m", "gossip", *METHODS[method](args.replicas)]
        command += ["--batch-size", str(args.batch_size), "--steps", str(args.steps)]
        command += ["--eval-every", str(args.eval_every)]
        command += ["--seed", str(seed), "--out", str(out)]
        print("gossip-train", *command[3:], flush=True)
        finished = subprocess.run(command, capture_output=True, text=True)
        if finished.returncode != 0:
            raise RuntimeError(f"{method} seed {seed} failed ({finished.returncode}):\n{finished.stderr[-2000:]}")
    return out


def curves(run_dir: Path) -> tuple[list[float], list[float]]:
    """A run's mean training loss at every step and its validation losses, from metrics.csv."""
    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [float(row["mean_loss"]) for row in rows], [float(row["val_loss"]) for row in rows if row["val_loss"]]


def row_of(method: str, seed: int, run_dir: Path, reference: Path | None) -> dict[str, object]:
    """The CSV row of one run; with ``reference``, the largest gaps to it (training loss, validation loss)."""
    result = json.loads((run_dir / "result.json").read_text())
    row: dict[str, object] = {"method": method, "seed": seed, **{key: result.get(key, "") for key in COLUMNS}}
    row["max_train_loss_gap"] = row["max_val_loss_gap"] = ""
    if reference is not None:
        (train, val), (train_ref, val_ref) = curves(run_dir), curves(reference)
        row["max_train_loss_gap"] = max(abs(a - b) for a, b in zip(train, train_ref, strict=True))
        row["max_val_loss_gap"] = max(abs(a - b) for a, b in zip(val, val_ref, strict=True))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("runs/sharded"), help="run directories")
    parser.add_argument("--csv", default="sharded_vs_unsharded.csv", help="file name under results/")
    args = parser.parse_args(argv)
    parser.add_argument("--methods", nargs="+", default=list(TWINS), choices=list(TWINS), help="sharded methods")
    args = parser.parse_args(argv)
    rows = []
    for sharded_method in args.methods:
        twin = TWINS[sharded_method]
        for seed in args.seeds:
            unsharded = run_once(twin, seed, args)
            sharded = run_once(sharded_method, seed, args)
            rows += [row_of(twin, seed, unsharded, None), row_of(sharded_method, seed, sharded, unsharded)]
    write_csv(RESULTS / args.csv, rows)
    for method in dict.fromkeys(row["method"] for row in rows):
        values = [float(row["final_val_loss"]) for row in rows if row["method"] == method]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{method:16s} final_val_loss {statistics.mean(values):.4f} ± {spread:.4f}")
    for sharded_method in args.methods:
        gaps = [float(row["max_train_loss_gap"]) for row in rows if row["method"] == sharded_method]
        twin = TWINS[sharded_method]
        print(f"largest gap {sharded_method} - {twin} over every step's training loss: {max(gaps):.3g}")
