r"""Where the step time of finished time-to-loss runs goes: compute, and the wait for communication.

Every rank of a gossip-train run writes ``metrics_rank<r>.jsonl`` (``gossip/wrapper/metrics.py``) with, per step,
``compute_seconds`` (from posting the exchange to the optimizer step: the batch, forward and backward, with whatever
is posted or waited for inside backward's hooks: PowerGossip's further power iterations, DDP's all-reduce),
``finish_seconds`` (completing the exchange: the wait plus the mixing arithmetic), ``wait_seconds`` (the part of
it blocked on communication) and ``step_seconds`` (the whole step). This module
averages them per (rate, method) over every rank, every seed and every step after ``CLOCK_START_STEP``, separately
for two kinds of step:

* **synchronisation steps**: the steps that sent more bytes than the run's median step (an outer step's all-reduce
  of the whole model among PowerGossip's few-kB steps, an exact average among gossip steps);
* **gossip steps**: all the others (all of a run that sends the same bytes every step).

For the synchronisation steps it also gives the **arrival spread**: per pair of consecutive synchronisation steps
a < b, max_r - min_r over the ranks of (end of step b - 1) - (end of step a), each on rank r's own clock
(``elapsed_seconds``). The ranks leave a synchronisation step together (its all-reduce completes on all of them
within a transfer of one another), so this is how far apart they reach the next one, which an all-reduce waits out.

It answers "did a change move time between compute and wait, and on which steps", e.g. when work moves from the
optimizer step into backward on a machine whose cores are all busy.

    python -m experiments.time_to_loss.phases runs/time_to_loss --csv steptime_phases.csv

Prints one line per (runs directory, rate, method, kind) and, with ``--csv``, writes them to ``<results>/<csv>``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from experiments.time_to_loss.study import CLOCK_START_STEP, RESULTS, BenchmarkError, finished_runs, write_table

PHASES = ("step_seconds", "compute_seconds", "finish_seconds", "wait_seconds")
FIELDS = ("runs", "rate", "method", "kind", "seeds", "samples", "step_ms", "compute_ms", "finish_ms", "wait_ms",
          "arrival_spread_ms")  # fmt: skip


def read_steps(run_dir: Path) -> list[list[dict]]:
    """Every rank's per-step metrics of one run, steps after ``CLOCK_START_STEP``: one list per rank."""
    paths = sorted(Path(run_dir).glob("metrics_rank*.jsonl"))
    if not paths:
        raise BenchmarkError(f"{run_dir}: no metrics_rank*.jsonl (not a gossip-train run?)")
    ranks = []
    for path in paths:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        missing = [key for key in (*PHASES, "bytes_sent", "elapsed_seconds") if rows and key not in rows[0]]
        if missing:
            raise BenchmarkError(f"{path}: no {', '.join(missing)} in its steps")
        ranks.append([row for row in rows if row["step"] > CLOCK_START_STEP])
    return ranks


def split(ranks: list[list[dict]]) -> dict[str, list[dict]]:
    """The steps of one run by kind: ``sync`` (more bytes sent than the run's median step) and ``gossip``."""
    sent = [row["bytes_sent"] or 0 for rows in ranks for row in rows]
    if not sent:
        return {"gossip": [], "sync": []}
    median = statistics.median(sent)
    kinds: dict[str, list[dict]] = {"gossip": [], "sync": []}
    for rows in ranks:
        for row in rows:
            kinds["sync" if (row["bytes_sent"] or 0) > median else "gossip"].append(row)
    return kinds


def arrival_spreads(ranks: list[list[dict]], sync: list[dict]) -> list[float]:
    """Per pair of consecutive synchronisation steps of one run (``sync``: its rows of that kind, from :func:`split`):
    the ranks' arrival spread in seconds (module doc)."""
    syncs = sorted({row["step"] for row in sync})
    ends = [{row["step"]: row["elapsed_seconds"] for row in rows} for rows in ranks]
    spreads = []
    for first, second in itertools.pairwise(syncs):
        if second - 1 > first and all(first in end and second - 1 in end for end in ends):
            between = [end[second - 1] - end[first] for end in ends]
            spreads.append(max(between) - min(between))
    return spreads


def phases(root: Path) -> list[dict]:
    """Per (rate, method, kind) of the finished runs under ``root``: mean step, compute, finish and wait in ms, and
    on synchronisation steps the mean arrival spread."""
    pooled: dict[tuple[str, str, str], tuple[set[int], list[dict]]] = {}
    spreads: dict[tuple[str, str], list[float]] = {}
    for (_stamp, rate, _repeat, seed), runs in finished_runs(root).items():
        for method, run_dir in runs:
            if not any(run_dir.glob("metrics_rank*.jsonl")):
                continue  # decent-dp's runner writes metrics.csv only
            ranks = read_steps(run_dir)
            kinds = split(ranks)
            spreads.setdefault((rate, method), []).extend(arrival_spreads(ranks, kinds["sync"]))
            for kind, rows in kinds.items():
                seeds, samples = pooled.setdefault((rate, method, kind), (set(), []))
                seeds.add(seed)
                samples.extend(rows)
    table = []
    for (rate, method, kind), (seeds, rows) in sorted(pooled.items()):
        if not rows:
            continue
        means = {key: 1000 * statistics.fmean(row[key] for row in rows) for key in PHASES}
        table.append(
            {
                "runs": Path(root).name,
                "rate": rate,
                "method": method,
                "kind": kind,
                "seeds": " ".join(map(str, sorted(seeds))),
                "samples": len(rows),
                "step_ms": round(means["step_seconds"], 1),
                "compute_ms": round(means["compute_seconds"], 1),
                "finish_ms": round(means["finish_seconds"], 1),
                "wait_ms": round(means["wait_seconds"], 1),
                "arrival_spread_ms": spread_ms(spreads.get((rate, method), [])) if kind == "sync" else "",
            }
        )
    return table


def spread_ms(spreads: list[float]) -> float | str:
    """The mean arrival spread in ms, rounded; "" when there is none (fewer than two synchronisation steps)."""
    return round(1000 * statistics.fmean(spreads), 1) if spreads else ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path, help="directories of finished runs (time_to_loss --runs)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the CSV goes")
    parser.add_argument("--csv", default=None, help="CSV file name inside --results (default: print only)")
    args = parser.parse_args(argv)
    table = [row for root in args.roots for row in phases(root)]
    if not table:
        raise BenchmarkError(f"no gossip-train runs under {', '.join(map(str, args.roots))}")
    for row in table:
        print(
            f"{row['runs']:>12} {row['rate']:>8} {row['method']:<28} {row['kind']:<6} seeds {row['seeds']:<6} "
            f"ms: step {row['step_ms']:6.1f}, compute {row['compute_ms']:6.1f}, finish {row['finish_ms']:6.1f} "
            f"(wait {row['wait_ms']:6.1f})"
            + (f", arrival spread {row['arrival_spread_ms']}" if row["arrival_spread_ms"] != "" else "")
        )
    if args.csv:
        write_table(args.results / args.csv, FIELDS, table)
        print(f"wrote {args.results / args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
