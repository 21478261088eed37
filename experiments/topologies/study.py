r"""Topologies at n = 16, 32, 64 on the in-process simulator: consensus speed and a decentralized training toy.

(a) Consensus (docs/design.md F.3/F.4, reproduction R4's schedules at larger n). The relative disagreement after t
steps is :math:`\Xi_t^2 / \Xi_0^2` with :math:`\Xi^2 = \frac1n \sum_i \|x_i - \bar x\|^2`.

* Exact gossip, every built-in schedule that exists for n: :func:`topologies.analysis.steps_to_consensus`, the
  smallest t with :math:`\|(I - J) W(t-1) \cdots W(0)\|_2^2 \le 10^{-6}` -- the worst case over all initial
  vectors, which is what exact gossip on any tensor does (it is linear and acts on every coordinate alike).
* PowerGossip (rank 1, 2, 4; warm start, one power iteration, docs/design.md A) on the symmetric schedules: the
  real :class:`gossip.PowerGossip` on :func:`gossip.simulate`, one random 32 x 32 matrix per rank; the disagreement
  is measured every 10 steps up to a step cap per n (the simulator costs ~70 ms per step at n = 64 on 2 cores).

(b) Training toy (R7/R8 at larger n): decentralized SGD on a least-squares problem with
:math:`f_i(x) = \frac{1}{2m}\|A_i x - b_i\|^2`, :math:`x \in \mathbb{R}^{32}`, one step

.. math::  x_i^{t+1} = \sum_j W_{ij}(t)\, x_j^t - \eta\, \tilde g_i(x_i^t)

(the overlapped order of B.1: the mixing of :math:`x^t` and the stochastic gradient at :math:`x^t`, batch 8 rows).
i.i.d.: :math:`b_i = A_i x^\star + 0.1\,\varepsilon`; non-i.i.d.: :math:`b_i = A_i (x^\star + \delta_i) + 0.1\,
\varepsilon` with :math:`\|\delta_i\| \approx 1`. Reported: :math:`\frac1n \sum_i f_i(\bar x)` at the end (the loss
of the averaged model) minus its minimum :math:`f^\star` (solved from the normal equations summed over ranks) --
the excess loss; the All-Reduce run (parameter averaging every step) is the reference -- and the consensus
distance :math:`\Xi` after the last local update (so All-Reduce's is one step's spread, not 0).

    python -m experiments.topologies            # ~5-8 min on 2 cores; writes experiments/topologies/results/*.csv
    python -m experiments.topologies --print-tables
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch

import gossip
import topologies
from experiments.allreduce_vs_gossip.study import SCHEDULES
from gossip.algorithms.buckets import pack
from topologies.analysis import steps_to_consensus

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (16, 32, 64)
TOL = 1e-6
POWER_RANKS = (1, 2, 4)
STEP_CAP = {16: 400, 32: 200, 64: 100}  # PowerGossip consensus: steps simulated at most
CHECK_EVERY = 10
MATRIX_SIDE = 32
TOY_SCHEDULES = SCHEDULES  # the main-job comparison's set, so the two studies line up row for row
TOY_DIM, TOY_ROWS, TOY_BATCH, TOY_STEPS, TOY_LR = 32, 64, 8, 200, 0.05


def built_schedules(n: int) -> dict[str, topologies.Schedule]:
    """Every registered schedule that exists for ``n`` ranks (torus needs n = rows * cols, both >= 3, ...)."""
    schedules = {}
    for name in topologies.names():
        try:
            schedules[name] = topologies.by_name(name, n)
        except (topologies.ScheduleError, ValueError):
            continue
    return schedules


def is_symmetric(schedule: topologies.Schedule) -> bool:
    try:
        schedule.validate(symmetric=True)
    except topologies.ScheduleError:
        return False
    return True


def _disagreement(comm: gossip.Communicator, x: torch.Tensor) -> float:
    mean = x.clone()
    comm.all_reduce(mean, "avg")
    error = torch.tensor([float(((x - mean) ** 2).sum())], dtype=torch.float64)
    comm.all_reduce(error, "avg")
    return error.item()


def _power_consensus(comm: gossip.Communicator, rank: int, schedule: topologies.Schedule, cap: int) -> tuple:
    algorithm = gossip.PowerGossip(rank=rank, min_compression=1)
    generator = torch.Generator().manual_seed(1000 + comm.rank)
    buckets = pack([("X", torch.randn(MATRIX_SIDE, MATRIX_SIDE, generator=generator, dtype=torch.float64))])
    algorithm.setup(comm, schedule, buckets)
    initial = _disagreement(comm, buckets[0].buffer)
    relative = 1.0
    for step in range(cap):
        algorithm.step(step)
        if (step + 1) % CHECK_EVERY == 0:
            relative = _disagreement(comm, buckets[0].buffer) / initial
            if relative <= TOL:
                return step + 1, relative
    return None, relative


def consensus_rows(sizes: tuple[int, ...]) -> list[dict[str, object]]:
    """(a): one row per (n, schedule, algorithm, rank)."""
    rows = []
    for n in sizes:
        for name, schedule in built_schedules(n).items():
            steps = steps_to_consensus(schedule, TOL, max_steps=20_000)
            rows.append({"n": n, "schedule": name, "algorithm": "exact", "rank": "", "steps": steps or ">20000"})
            rows[-1]["relative_at_end"] = ""
            print(rows[-1], flush=True)
            if name not in TOY_SCHEDULES or not is_symmetric(schedule):
                continue
            for rank in POWER_RANKS:
                reached, relative = gossip.simulate(n, _power_consensus, rank, schedule, STEP_CAP[n])[0]
                steps = reached if reached is not None else f">{STEP_CAP[n]}"
                rows.append({"n": n, "schedule": name, "algorithm": "powergossip", "rank": rank, "steps": steps})
                rows[-1]["relative_at_end"] = f"{relative:.3g}"
                print(rows[-1], flush=True)
    return rows


def _toy_worker(comm: gossip.Communicator, algorithm_name: str, schedule: topologies.Schedule | None, split: str):
    truth = torch.randn(TOY_DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    generator = torch.Generator().manual_seed(100 + comm.rank)
    features = torch.randn(TOY_ROWS, TOY_DIM, generator=generator, dtype=torch.float64)
    target = truth.clone()
    if split == "noniid":
        target += torch.randn(TOY_DIM, generator=generator, dtype=torch.float64) / math.sqrt(TOY_DIM)
    labels = features @ target + 0.1 * torch.randn(TOY_ROWS, generator=generator, dtype=torch.float64)
    buckets = pack([("x", torch.zeros(TOY_DIM, dtype=torch.float64))])
    x = buckets[0].buffer
    algorithm = gossip.ALGORITHMS[algorithm_name]()
    algorithm.setup(comm, schedule, buckets)
    for step in range(TOY_STEPS):
        rows = torch.randint(0, TOY_ROWS, (TOY_BATCH,), generator=generator)
        gradient = features[rows].T @ (features[rows] @ x - labels[rows]) / TOY_BATCH
        algorithm.step(step)  # x <- sum_j W_ij x_j (the mixing of x^t)
        x -= TOY_LR * gradient  # minus eta * g_i(x^t)
    average = x.clone()
    comm.all_reduce(average, "avg")
    normal = torch.cat([features.T @ features, (features.T @ labels)[:, None]], dim=1)
    comm.all_reduce(normal, "sum")
    optimum = torch.linalg.solve(normal[:, :-1], normal[:, -1])  # argmin of (1/n) sum_i f_i
    losses = torch.tensor([_loss(features, labels, average), _loss(features, labels, optimum)], dtype=torch.float64)
    comm.all_reduce(losses, "avg")
    return float(losses[0] - losses[1]), math.sqrt(_disagreement(comm, x))


def _loss(features: torch.Tensor, labels: torch.Tensor, x: torch.Tensor) -> float:
    return 0.5 * float(((features @ x - labels) ** 2).mean())


def training_rows(sizes: tuple[int, ...]) -> list[dict[str, object]]:
    """(b): one row per (n, split, schedule) with exact gossip, plus All-Reduce as the reference."""
    rows = []
    for n in sizes:
        schedules = built_schedules(n)
        for split in ("iid", "noniid"):
            runs = [("allreduce", "(all-reduce)")] + [("exact", name) for name in TOY_SCHEDULES if name in schedules]
            for algorithm, name in runs:
                schedule = schedules.get(name, topologies.by_name("ring", n))
                loss, consensus = gossip.simulate(n, _toy_worker, algorithm, schedule, split)[0]
                rows.append({"n": n, "split": split, "algorithm": algorithm, "schedule": name})
                rows[-1].update(excess_loss_at_average=f"{loss:.3g}", consensus_distance=f"{consensus:.3g}")
                print(rows[-1], flush=True)
    return rows


def write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def pivot_table(path: Path, row_keys: tuple[str, ...], value: str, column_key: str = "n") -> str:
    """A markdown table of ``path``: one line per ``row_keys`` value, one column per ``column_key`` value."""
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    columns = sorted({row[column_key] for row in rows}, key=int)
    cells: dict[tuple, dict[str, str]] = {}
    for row in rows:
        cell = row[value]
        if row.get("relative_at_end") and str(cell).startswith(">"):
            cell = f"{cell} ({row['relative_at_end']})"  # not reached: the relative disagreement at the cap
        cells.setdefault(tuple(row[key] for key in row_keys), {})[row[column_key]] = cell
    lines = ["| " + " | ".join([*row_keys, *(f"{column_key}={c}" for c in columns)]) + " |"]
    lines.append("|" + "---|" * (len(row_keys) + len(columns)))
    for key, by_column in cells.items():
        lines.append("| " + " | ".join([*key, *(by_column.get(c, "-") for c in columns)]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--part", choices=("all", "consensus", "training"), default="all")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--print-tables", action="store_true", help="print the CSVs as markdown tables and exit")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if args.print_tables:
        print(pivot_table(results / "topology_consensus.csv", ("schedule", "algorithm", "rank"), "steps"))
        print()
        print(
            pivot_table(results / "topology_training.csv", ("split", "algorithm", "schedule"), "excess_loss_at_average")
        )
        print()
        print(pivot_table(results / "topology_training.csv", ("split", "algorithm", "schedule"), "consensus_distance"))
        return 0
    results.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    started = time.perf_counter()
    if args.part in ("all", "consensus"):
        write_csv(results / "topology_consensus.csv", consensus_rows(tuple(args.sizes)))
    if args.part in ("all", "training"):
        write_csv(results / "topology_training.csv", training_rows(tuple(args.sizes)))
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
