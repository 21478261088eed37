r"""Validate the runtime model (experiments.runtime_model, docs/design.md B.5) against emulated runs.

For each run (short dedicated runs here, and optionally the time-to-loss runs) the measured per-iteration time is
the mean ``step_seconds`` over ranks and steps >= 2 (the first two steps carry one-off set-up). The model gets:

* ``compute_ms``: forward + backward + loop overhead per step, mean ``compute_seconds`` of the PowerGossip r=1 run
  with the same hosts and rate (the least traffic, so mostly computation, measured while all n processes run);
  ``optimizer_ms`` U: that run's mean ``step - compute - wait`` (optimizer and mixing arithmetic);
  ``compute_cv``: that run's coefficient of variation of compute_seconds over ranks and steps;
* latency 0.03 ms (veth + htb, netem README: Gloo half RTT 0.032-0.036 ms), bandwidth = the nominal per-host rate;
  Gloo's ring All-Reduce (``allreduce_algorithm="ring"``); model bytes 4 x parameters;
* message bytes per peer: the model (exact gossip, decent-dp) or the measured ``bytes_sent`` per step
  (PowerGossip, one peer per step on the one-peer hypercube);
* schedules: one_peer_hypercube (exact, PowerGossip, decent-dp's one-peer-exp: the same pairs for n = 4, 8), ring.

The emulation has n processes on 2 cores, so compute is CPU-bound and shared. The contention factor
:math:`\kappa_n = C_n / C_1` (compute per step with n processes running / with one process alone, both with one
thread) is measured and reported; a second prediction uses :math:`C_1` to show what the model says without it.

    python -m experiments.runtime_model.validate --hosts 4 8 --rates 1gbit 100mbit --steps 40 \
        [--time-to-loss-runs runs/time_to_loss]

Writes ``<results>/runtime_validation.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from experiments.rates import parse_rate
from experiments.runtime_model.cli import validation_table
from experiments.time_to_loss.study import METHODS, run_method

RESULTS = Path(__file__).resolve().parent / "results"
LATENCY_MS = 0.03
WARMUP_STEPS = 2
SCHEDULE_OF = {"exact-ring": "ring"}  # every other gossip method: one_peer_hypercube
ALGORITHM_OF = {
    "ddp": "allreduce",
    "exact": "exact",
    "exact-ring": "exact",
    "exact-adamw": "exact",
    "decentdp": "exact",
}
RUN_NAME = re.compile(
    r"(?P<stamp>\d{8}-\d{6})-(?:n(?P<hosts>\d+)-)?(?P<rate>[0-9.]+[a-z]+)-r(?P<repeat>\d+)-(?P<method>[a-z0-9-]+)"
)


def run_statistics(run_dir: Path) -> dict:
    """Per-step means over ranks and steps >= WARMUP_STEPS: step, compute, wait ms; cv of compute; bytes/step."""
    files = sorted(Path(run_dir).glob("metrics_rank*.jsonl"))
    if files:
        rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    else:  # decentdp_runner: rank 0's metrics.csv only (no compute/wait split)
        with open(Path(run_dir) / "metrics.csv", newline="") as file:
            rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(file)]
    rows = [r for r in rows if r["step"] >= WARMUP_STEPS]
    if not rows:
        raise ValueError(f"{run_dir}: no steps after the first {WARMUP_STEPS}")

    def column(name: str) -> np.ndarray:
        return np.array([r.get(name, np.nan) for r in rows], dtype=float)

    compute = column("compute_seconds")
    return {
        "step_ms": 1e3 * float(np.mean(column("step_seconds"))),
        "compute_ms": 1e3 * float(np.mean(compute)),
        "wait_ms": 1e3 * float(np.mean(column("wait_seconds"))),
        "compute_cv": float(np.std(compute) / np.mean(compute)),
        "bytes_per_step": float(np.mean(column("bytes_sent"))),
        "steps": len({r["step"] for r in rows}),
        "ranks": max(1, len(files)),
    }


def model_size_bytes() -> int:
    """Bytes of the task's GPT parameters (float32): what exact gossip sends per peer and DDP all-reduces."""
    from gossip.app.gpt import GPT, GPTConfig

    return sum(p.numel() * p.element_size() for p in GPT(GPTConfig()).parameters())


def compute_alone_ms(steps: int = 30, batch_size: int = 8) -> float:
    """Forward + backward + AdamW step of the task's GPT in this process, one thread, nothing else of ours running;
    mean ms over ``steps`` after 3 warm-up steps."""
    from gossip.app.corpus import ShardedBatches, load_corpus
    from gossip.app.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    config = GPTConfig()
    corpus = load_corpus(None, block_size=config.block_size)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = ShardedBatches(corpus.train, 0, 1, batch_size, config.block_size)
    times = []
    for step in range(steps + 3):
        x, y = batches.batch(step)
        started = time.perf_counter()
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.mean(times[3:]))


def validation_rows(runs: Sequence[dict], model_bytes: int, alone_ms: float) -> tuple[list[dict], list[dict]]:
    """Rows for validation_table: with the in-run compute (contended) and with compute alone (C_1)."""
    reference = {(r["hosts"], r["rate"]): r for r in runs if r["method"] == "pg1"}
    contended, alone = [], []
    for run in runs:
        ref = reference.get((run["hosts"], run["rate"]))
        if ref is None:
            raise ValueError(f"no pg1 run with {run['hosts']} hosts at {run['rate']}: it supplies the compute time")
        method = run["method"]
        row = {
            "label": f"{method} {run['rate']} {run['source'].split('-')[0]}",
            "source": run["source"],
            "measured_ms": run["step_ms"],
            "n": run["hosts"],
            "algorithm": "powergossip" if method.startswith("pg") else ALGORITHM_OF[method],
            "schedule": None if method == "ddp" else SCHEDULE_OF.get(method, "one_peer_hypercube"),
            "compute_ms": ref["compute_ms"],
            "compute_cv": ref["compute_cv"],
            "optimizer_ms": max(0.0, ref["step_ms"] - ref["compute_ms"] - ref["wait_ms"]),
            "model_bytes": model_bytes,
            "latency_ms": LATENCY_MS,
            "bandwidth_Bps": parse_rate(run["rate"], unit="byte/s"),
            "allreduce_algorithm": "ring",
        }
        if method.startswith("pg"):
            row["message_bytes"] = run["bytes_per_step"]
        contended.append(row)
        alone.append({**row, "compute_ms": alone_ms, "optimizer_ms": 0.0, "compute_cv": 0.0})
    return contended, alone


def dedicated_runs(hosts: Sequence[int], rates: Sequence[str], methods: Sequence[str], steps: int, out: Path) -> list:
    """Run every method for ``steps`` on every (hosts, rate) network; return their run directories."""
    from experiments.netem import EmulatedNetwork

    stamp, port, runs = time.strftime("%Y%m%d-%H%M%S"), 29800, []
    for n in hosts:
        for rate in rates:
            with EmulatedNetwork(hosts=n, rate=rate) as net:
                for method in methods:
                    run_dir = out / f"{stamp}-n{n}-{rate}-r0-{method}"
                    run_dir.parent.mkdir(parents=True, exist_ok=True)
                    port += 1
                    wall = run_method(net, METHODS[method], steps, 8, run_dir, port, Path(f"{run_dir}.log"))
                    print(f"n={n} {rate} {method}: {wall:.0f} s wall", flush=True)
                    runs.append(
                        {"hosts": n, "rate": rate, "method": method, "dir": run_dir, "source": f"{steps}st-{stamp}"}
                    )
    return runs


def finished_runs(root: Path, hosts: int, prefix: str) -> list[dict]:
    """Finished runs under ``root`` named ``<stamp>-[n<hosts>-]<rate>-r<k>-<method>`` (time_to_loss and this
    script); ``hosts`` when the name has none. Each run's ``source`` is ``<prefix><steps>st-<stamp>``."""
    found = []
    for path in sorted(p for p in Path(root).iterdir() if p.is_dir() and (p / "metrics.csv").exists()):
        match = RUN_NAME.fullmatch(path.name)
        if match and (match["method"] in ALGORITHM_OF or match["method"].startswith("pg")):
            steps = json.loads((path / "config.json").read_text())["steps"]
            found.append(
                {
                    "hosts": int(match["hosts"] or hosts),
                    "rate": match["rate"],
                    "method": match["method"],
                    "dir": path,
                    "source": f"{prefix}{steps}st-{match['stamp']}",
                }
            )
    return found


FIELDS = ("label", "source", "n", "algorithm", "schedule", "rate", "measured_ms", "predicted_ms", "relative_error",
          "predicted_alone_ms", "relative_error_alone", "compute_ms", "compute_alone_ms", "contention_factor",
          "compute_cv", "optimizer_ms", "measured_compute_ms", "measured_wait_ms", "message_bytes", "model_bytes",
          "latency_ms", "bandwidth_Bps")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.runtime_model.validate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--methods", nargs="+", default=["ddp", "exact", "exact-ring", "pg1"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", default="runs/runtime_validation", help="where the dedicated runs go")
    parser.add_argument("--reuse", action="store_true", help="use the finished runs in --runs, train none")
    parser.add_argument("--time-to-loss-runs", default=None, help="also use these time-to-loss runs (8 hosts)")
    parser.add_argument("--ttl-hosts", type=int, default=8, help="hosts of the time-to-loss runs")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    if "pg1" not in args.methods:
        parser.error("--methods must include pg1 (its compute time is the model's compute input)")
    alone_before = compute_alone_ms()
    if args.reuse:
        runs = finished_runs(Path(args.runs), 0, "")
    else:
        runs = dedicated_runs(args.hosts, args.rates, args.methods, args.steps, Path(args.runs))
    if args.time_to_loss_runs:
        runs += finished_runs(Path(args.time_to_loss_runs), args.ttl_hosts, "ttl")
    alone_after = compute_alone_ms()
    alone = (alone_before + alone_after) / 2
    print(f"compute alone (1 process, 1 thread): {alone_before:.1f} ms before, {alone_after:.1f} ms after the runs")
    for run in runs:
        run.update(run_statistics(run["dir"]))
    groups = {}
    for run in runs:  # pg1 of the same source supplies compute (dedicated runs first, then time-to-loss runs)
        groups.setdefault(run["source"], []).append(run)
    model_bytes = model_size_bytes()
    table = []
    for source, members in groups.items():
        contended, solo = validation_rows(members, model_bytes, alone)
        print(f"\n{source}: compute = in-run pg1 compute (n processes on 2 cores)")
        with_contention = validation_table(contended)
        print(f"{source}: compute = one process alone ({alone:.1f} ms), no contention")
        without = validation_table(solo)
        for run, a, b in zip(members, with_contention, without, strict=True):
            table.append(
                {
                    **{k: a.get(k) for k in FIELDS if k in a},
                    "rate": run["rate"],
                    "predicted_alone_ms": b["predicted_ms"],
                    "relative_error_alone": b["relative_error"],
                    "compute_alone_ms": alone,
                    "contention_factor": a["compute_ms"] / alone,
                    "measured_compute_ms": run["compute_ms"],
                    "measured_wait_ms": run["wait_ms"],
                }
            )
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "runtime_validation.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {results / 'runtime_validation.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
