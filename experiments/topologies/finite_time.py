"""Steps to the exact average for any n: the one-peer Base-2 graph against the one-peer hypercube and the others.

For every n in ``--sizes``: the period of :func:`topologies.base_graph` (one peer a step; the product over a period
is exactly J, checked here on random vectors), log2 n for the one-peer hypercube where n is a power of two, and
for comparison the worst-case steps to a relative disagreement of 1e-6 (:func:`topologies.steps_to_consensus`) of
the Base-2 graph itself, the one-peer hypercube, random matchings (one peer a step, any n), the ring and the static
exponential graph (log2 n peers a step). Writes ``results/finite_time.csv`` and prints the table.

    python -m experiments.topologies.finite_time
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

import topologies
from experiments.shared import write_csv

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (3, 5, 6, 7, 12, 16, 24, 32, 48, 64, 96, 100, 128)
COMPARED = ("one_peer_hypercube", "random_matchings", "ring", "static_exponential")


def exact_after_one_period(schedule: topologies.Schedule) -> bool:
    """Whether one period from step 0 leaves every rank with the mean of random vectors (to 1e-12 of their scale)."""
    start = np.random.default_rng(0).standard_normal((schedule.n, 4))
    values = start
    for t in range(schedule.period):
        values = topologies.analysis.apply_step(schedule, t, values)
    return bool(np.abs(values - start.mean(axis=0)).max() <= 1e-12 * np.abs(start).max())


def row(n: int) -> dict[str, object]:
    """The measurements for n ranks."""
    base = topologies.base_graph(n)
    result: dict[str, object] = {
        "n": n,
        "base_graph_period": base.period,
        "base_graph_exact": exact_after_one_period(base),
        "hypercube_log2n": int(math.log2(n)) if n & (n - 1) == 0 else "",
        "base_graph_to_1e-6": topologies.steps_to_consensus(base),
    }
    for name in COMPARED:
        try:
            schedule = topologies.by_name(name, n)
        except topologies.ScheduleError:
            result[f"{name}_to_1e-6"] = ""
            continue
        result[f"{name}_to_1e-6"] = topologies.steps_to_consensus(schedule, max_steps=20_000)
    return result


def main(argv: list[str] | None = None) -> int:
    """Measure every size and write the table.

    Args:
        argv: the command-line arguments.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args(argv)
    rows = [row(n) for n in args.sizes]
    write_csv(RESULTS / "finite_time.csv", rows)
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
