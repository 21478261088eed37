"""Time to build and validate a static schedule as n grows (issue 31: complete(1024) took about a minute).

For each n, each schedule is built ``--repeats`` times from scratch (construction runs the full validation:
non-negative, row-stochastic, peer-consistency, strongly connected; ``validate(symmetric=True,
doubly_stochastic=True)`` then checks the two optional properties as well) and the best wall-clock and CPU times
are printed. The edge count is printed beside them: construction and validation read each entry of W a bounded
number of times, so the time per entry should stay roughly flat as n grows.

Usage::

    python benchmarks/topology_build.py                          # complete, n = 64 .. 1024
    python benchmarks/topology_build.py --schedules complete ring hypercube --sizes 256 1024 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import topologies


def measure(name: str, n: int, repeats: int) -> tuple[float, float, int]:
    """Best wall-clock and CPU seconds over ``repeats`` builds + full validations, and the entries of W(0)."""
    best_wall = best_cpu = float("inf")
    entries = 0
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        schedule = topologies.by_name(name, n)
        schedule.validate(symmetric=schedule.is_symmetric, doubly_stochastic=schedule.is_doubly_stochastic)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
        entries = schedule.triplets(0)[0].size
    return best_wall, best_cpu, entries


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=["complete"], choices=topologies.names())
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'schedule':<14}{'n':>6}{'entries':>10}{'wall s':>9}{'cpu s':>9}{'us/entry':>10}")
    for name in args.schedules:
        for n in args.sizes:
            wall, cpu, entries = measure(name, n, args.repeats)
            print(f"{name:<14}{n:>6}{entries:>10}{wall:>9.3f}{cpu:>9.3f}{1e6 * cpu / entries:>10.3f}")


if __name__ == "__main__":
    main()
