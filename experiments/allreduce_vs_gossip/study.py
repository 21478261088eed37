"""All-Reduce (torch DDP) vs exact gossip vs PowerGossip on the main job's task, through the public CLI.

Every run is ``python -m gossip --nproc N --algorithm A [--schedule S] [--rank R] --split SPLIT --steps T
--batch-size B --out <workdir>/<name>`` (the ``gossip-train`` command), one after another; this script reads each
run's ``result.json`` and ``metrics.csv`` and writes:

* ``<results>/compare.csv`` -- one row per run: final train loss (mean of the last 10 steps over ranks), validation
  loss of the averaged model, exact consensus distance, bytes sent per worker per step, mean step time and exposed
  communication (the wrapper's metrics; for DDP the ring all-reduce bytes 2(n-1)/n * gradient bytes);
* ``<results>/compare_loss_vs_step.png`` and ``compare_loss_vs_bytes.png`` for a few representative runs.

Runs whose ``result.json`` already exists in the work directory are read, not rerun (``--fresh`` reruns them).
``--print-table`` prints the markdown table of ``compare.csv`` for experiments/allreduce_vs_gossip/README.md.

    python -m experiments.allreduce_vs_gossip --nproc 4 --steps 150 --batch-size 8
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = (
    "ring",
    "torus",
    "static_exponential",
    "one_peer_hypercube",
    "one_peer_exponential",
    "alternating_exp_ring",
    "hierarchical",
)
SYMMETRIC_SCHEDULES = ("ring", "torus", "one_peer_hypercube", "alternating_exp_ring", "hierarchical")
FINAL_WINDOW = 10
COLUMNS = (
    "algorithm",
    "schedule",
    "rank",
    "split",
    "n",
    "steps",
    "batch_size",
    "final_train_loss",
    "final_val_loss",
    "consensus_distance",
    "bytes_per_worker_per_step",
    "mean_step_ms",
    "exposed_ms",
    "train_seconds",
)
REPRESENTATIVE = (
    ("ddp", "", 0),
    ("exact", "one_peer_hypercube", 0),
    ("exact", "ring", 0),
    ("powergossip", "one_peer_hypercube", 1),
    ("powergossip", "one_peer_hypercube", 4),
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One cell of the grid; ``schedule`` is "" and ``rank`` 0 where they do not apply."""

    algorithm: str
    schedule: str = ""
    rank: int = 0
    split: str = "iid"

    @property
    def name(self) -> str:
        parts = [self.algorithm, self.schedule, f"r{self.rank}" if self.rank else "", self.split]
        return "-".join(part for part in parts if part)

    def arguments(self) -> list[str]:
        args = ["--algorithm", self.algorithm, "--split", self.split]
        if self.schedule:
            args += ["--schedule", self.schedule]
        if self.rank:
            args += ["--rank", str(self.rank)]
        # the optimizer and power iterations of the table in this study's README.md, whatever gossip-train's defaults
        args += ["--optimizer", "accum-adamw"]
        if self.algorithm == "powergossip":
            args += ["--power-iterations", "1"]
        if self.algorithm in ("exact", "powergossip"):
            args += ["--outer-every", "0"]  # gossip alone, without the main job's average every 10 steps
        return args


def usable(schedule: str, n: int) -> bool:
    """Whether ``topologies.by_name(schedule, n)`` exists (e.g. torus needs n = rows * cols with both >= 3)."""
    import topologies

    try:
        topologies.by_name(schedule, n)
    except (topologies.ScheduleError, ValueError):
        return False
    return True


def default_grid(n: int) -> list[Run]:
    """i.i.d.: DDP, All-Reduce parameter averaging, exact gossip on every schedule that exists for ``n``,
    PowerGossip r = 1, 2, 4 on one_peer_hypercube and r = 1 on ring; non-i.i.d.: DDP, exact gossip on
    one_peer_hypercube and ring, PowerGossip r = 1 on one_peer_hypercube (16 runs at n = 4: ~21 min on 2 cores)."""
    runs = [Run("ddp"), Run("allreduce")]
    runs += [Run("exact", schedule) for schedule in SCHEDULES if usable(schedule, n)]
    runs += [Run("powergossip", "one_peer_hypercube", rank) for rank in (1, 2, 4)]
    runs += [Run("powergossip", "ring", 1)]
    runs += [
        Run("ddp", split="noniid"),
        Run("exact", "one_peer_hypercube", split="noniid"),
        Run("exact", "ring", split="noniid"),
        Run("powergossip", "one_peer_hypercube", 1, split="noniid"),
    ]
    return runs


def launch(run: Run, args: argparse.Namespace, out: Path) -> None:
    """Run ``gossip-train`` (``python -m gossip``) for ``run``; raise with its stderr if it fails."""
    command = [sys.executable, "-m", "gossip", "--nproc", str(args.nproc), *run.arguments()]
    command += ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    command += ["--eval-every", str(args.eval_every), "--out", str(out)]
    print(" ".join(command[1:]), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"run {run.name} failed ({result.returncode}):\n{result.stderr[-2000:]}")


def read_run(run: Run, args: argparse.Namespace, out: Path) -> dict[str, object]:
    """The compare.csv row of a finished run, from its result.json."""
    result = json.loads((out / "result.json").read_text())
    return {
        "algorithm": run.algorithm,
        "schedule": run.schedule or "(all-reduce)",
        "rank": run.rank or "",
        "split": run.split,
        "n": args.nproc,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "final_train_loss": round(result["final_train_loss"], 4),
        "final_val_loss": round(result["final_val_loss"], 4),
        "consensus_distance": float(f"{result['consensus_distance']:.4g}"),
        "bytes_per_worker_per_step": round(result["bytes_sent_per_worker_per_step"]),
        "mean_step_ms": round(1e3 * result["mean_step_seconds"], 1),
        "exposed_ms": round(1e3 * result["mean_exposed_seconds"], 2),
        "train_seconds": round(result["train_seconds"], 1),
    }


def read_curve(out: Path) -> tuple[list[int], list[float], list[float]]:
    """Steps, mean training loss over ranks (smoothed over FINAL_WINDOW steps) and cumulative bytes (rank 0)."""
    with open(out / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    losses = [float(row["mean_loss"]) for row in rows]
    smoothed = [sum(losses[max(0, i - FINAL_WINDOW + 1) : i + 1]) / min(i + 1, FINAL_WINDOW) for i in range(len(rows))]
    return [int(row["step"]) for row in rows], smoothed, [float(row["cumulative_bytes_sent"]) for row in rows]


def plot(curves: dict[str, tuple[list[int], list[float], list[float]]], results: Path) -> None:
    """Loss vs step and loss vs MB sent per worker (log x) for the representative runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, xlabel in (("loss_vs_step", "step"), ("loss_vs_bytes", "MB sent per worker (rank 0, cumulative)")):
        figure, axis = plt.subplots(figsize=(6.5, 4))
        for label, (steps, losses, sent) in curves.items():
            axis.plot(steps if name == "loss_vs_step" else [b / 1e6 for b in sent], losses, label=label)
        if name == "loss_vs_bytes":
            axis.set_xscale("log")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("train loss (mean over ranks, smoothed)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(results / f"compare_{name}.png", dpi=80)
        plt.close(figure)


def markdown_table(rows: list[dict[str, str]]) -> str:
    """compare.csv as a markdown table (the README's)."""
    header = ["algorithm", "schedule", "rank", "split", "train loss", "val loss", "consensus", "bytes/step"]
    header += ["step ms", "exposed ms"]
    keys = ["algorithm", "schedule", "rank", "split", "final_train_loss", "final_val_loss", "consensus_distance"]
    keys += ["bytes_per_worker_per_step", "mean_step_ms", "exposed_ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{int(row[key]):,}" if key == "bytes_per_worker_per_step" else row[key] for key in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="workers per run")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="runs/compare", help="where the run directories go")
    parser.add_argument("--results", default=str(RESULTS), help="where compare.csv and the plots go")
    parser.add_argument("--only", nargs="*", default=None, help="run names to run (default: the whole grid)")
    parser.add_argument("--fresh", action="store_true", help="rerun runs that already have a result.json")
    parser.add_argument("--print-table", action="store_true", help="print compare.csv as markdown and exit")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if args.print_table:
        with open(results / "compare.csv", newline="") as file:
            print(markdown_table(list(csv.DictReader(file))))
        return 0
    results.mkdir(parents=True, exist_ok=True)
    grid = [run for run in default_grid(args.nproc) if args.only is None or run.name in args.only]
    rows, curves, started = [], {}, time.perf_counter()
    for run in grid:
        out = Path(args.workdir) / f"n{args.nproc}-s{args.steps}-b{args.batch_size}" / run.name
        if args.fresh or not (out / "result.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            launch(run, args, out)
        rows.append(read_run(run, args, out))
        print(f"  {run.name}: {rows[-1]}  [{time.perf_counter() - started:.0f} s so far]", flush=True)
        if run.split == "iid" and (run.algorithm, run.schedule, run.rank) in REPRESENTATIVE:
            curves[run.name] = read_curve(out)
    with open(results / "compare.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    if curves:
        plot(curves, results)
    print(f"wrote {results / 'compare.csv'} ({len(rows)} runs, {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
