"""Tables and CLI for the runtime model (experiments.runtime_model): predictions for n = 64..1024, and
predicted-vs-measured validation.

    python -m experiments.runtime_model --model-mb 4.4 --compute-ms 100 --bandwidth 1gbit --latency-ms 1 [--cv 0.1]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

import topologies
from experiments.rates import RateError, parse_rate
from experiments.runtime_model.costs import Network, RuntimeModelError
from experiments.runtime_model.model import NODE_SCHEDULES, IterationPrediction, predict_iteration

DEFAULT_NS = (64, 128, 256, 512, 1024)
HIERARCHICAL_GOSSIP = "hierarchical_gossip"  # a table "schedule" that is its own algorithm (HierarchicalGossip)
TABLE_SCHEDULES = (
    "ring",
    "one_peer_hypercube",
    "one_peer_exponential",
    "static_exponential",
    "alternating_exp_ring",
    "hierarchical",
    HIERARCHICAL_GOSSIP,
)


def synthetic_param_shapes(model_bytes: float, width: int, bytes_per_element: int = 4) -> list[tuple[int, ...]]:
    """Square (width, width) matrices filling ``model_bytes``, plus one (rows, width) matrix and a 1-D rest."""
    elements = int(model_bytes // bytes_per_element)
    squares, rest = divmod(elements, width * width)
    shapes: list[tuple[int, ...]] = [(width, width)] * squares
    if rest // width:
        shapes.append((rest // width, width))
    if rest % width:
        shapes.append((rest % width,))
    return shapes


def powergossip_bytes_per_peer(
    param_shapes: Sequence[Sequence[int]], rank: int = 1, bytes_per_element: int = 4
) -> float:
    """Bytes PowerGossip sends to one peer per step (A.9), via topologies.bytes_per_step on a 1-peer schedule."""
    pair = topologies.one_peer_hypercube(2)  # exactly one out-peer per step
    return topologies.bytes_per_step(pair, param_shapes, "powergossip", rank, bytes_per_element, rank_id=0)


@dataclass(frozen=True)
class TableRow:
    method: str  # "allreduce", "exact", "powergossip"
    schedule: str  # "" for All-Reduce
    n: int
    prediction: IterationPrediction | None  # None when the method does not apply (reason in ``note``)
    speedup: float  # All-Reduce time / this time (nan when not applicable)
    note: str = ""


def predict_table(
    model_bytes: float,
    compute_s: float,
    network: Network,
    *,
    ns: Iterable[int] = DEFAULT_NS,
    powergossip_bytes: float | None = None,
    schedules: Sequence[str] = TABLE_SCHEDULES,
    compute_cv: float = 0.0,
    optimizer_s: float = 0.0,
    allreduce_algorithm: str = "best",
    file: TextIO | None = sys.stdout,
) -> list[TableRow]:
    """Predict All-Reduce, exact gossip and PowerGossip (if ``powergossip_bytes``) per n; print if ``file``.

    The schedule ``"hierarchical_gossip"`` is HierarchicalGossip (predict_iteration's algorithm of that name):
    its "exact" row sends the model's M/L shards across nodes, its "powergossip" row the compressed factors.
    """
    rows: list[TableRow] = []
    options = {"compute_cv": compute_cv, "optimizer_s": optimizer_s, "allreduce_algorithm": allreduce_algorithm}
    for n in ns:
        baseline = predict_iteration(compute_s, network, model_bytes, n, None, "allreduce", **options)
        rows.append(TableRow("allreduce", "", n, baseline, 1.0))
        for schedule in schedules:
            for method, message in (("exact", model_bytes), ("powergossip", powergossip_bytes)):
                if message is None:
                    continue
                try:
                    if (schedule in NODE_SCHEDULES or schedule == HIERARCHICAL_GOSSIP) and network.local_size < 2:
                        raise RuntimeModelError("needs local_size >= 2")
                    if schedule == HIERARCHICAL_GOSSIP:  # exact, or PowerGossip-compressed across nodes
                        got = predict_iteration(
                            compute_s, network, model_bytes, n, None, schedule, message_bytes=message, **options
                        )
                        got = dataclasses.replace(got, algorithm=f"{schedule} {method}")
                    else:
                        got = predict_iteration(
                            compute_s, network, model_bytes, n, schedule, method, message_bytes=message, **options
                        )
                    rows.append(TableRow(method, schedule, n, got, baseline.total_s / got.total_s))
                except ValueError as err:  # RuntimeModelError or topologies.ScheduleError: not applicable
                    rows.append(TableRow(method, schedule, n, None, math.nan, str(err).split(";")[0]))
    if file is not None:
        text = format_table(rows, model_bytes, compute_s, network, compute_cv, powergossip_bytes, allreduce_algorithm)
        print(text, file=file)
    return rows


def format_table(
    rows: Sequence[TableRow],
    model_bytes: float,
    compute_s: float,
    network: Network,
    compute_cv: float,
    powergossip_bytes: float | None,
    allreduce_algorithm: str = "best",
) -> str:
    """The text printed by predict_table: ms per iteration (speedup vs All-Reduce) and who wins per n."""
    ns = sorted({r.n for r in rows})
    methods = list(dict.fromkeys((r.method, r.schedule) for r in rows))
    unusable = [m for m in methods if all(r.prediction is None for r in rows if (r.method, r.schedule) == m)]
    methods = [m for m in methods if m not in unusable]
    cell = {(r.method, r.schedule, r.n): r for r in rows}
    pg = "" if powergossip_bytes is None else f", PowerGossip {powergossip_bytes / 1e3:.1f} kB/peer/step"
    lines = [
        f"model {model_bytes / 1e6:.2f} MB{pg}; compute {1e3 * compute_s:.1f} ms (cv {compute_cv:.2f}); "
        f"network alpha {1e3 * network.latency_s:.3g} ms, {8 * network.bandwidth_Bps / 1e9:.3g} Gbit/s, "
        f"local_size {network.local_size}",
        f"mean ms per iteration (speedup over All-Reduce, T_AR = {allreduce_algorithm} of ring/halving-doubling)"
        if allreduce_algorithm == "best"
        else "mean ms per iteration (speedup over ring All-Reduce)",
        f"{'method':<34}" + "".join(f"{f'n={n}':>18}" for n in ns),
    ]
    for method, schedule in methods:
        label = "all-reduce (DDP)" if method == "allreduce" else f"{method} {schedule}"
        texts = []
        for n in ns:
            r = cell.get((method, schedule, n))
            if r is None or r.prediction is None:
                texts.append("n/a")
            elif method == "allreduce":
                texts.append(f"{1e3 * r.prediction.total_s:.1f}")
            else:
                texts.append(f"{1e3 * r.prediction.total_s:.1f} ({r.speedup:.2f}x)")
        lines.append(f"{label:<34}" + "".join(f"{t:>18}" for t in texts))
    for method, schedule in unusable:
        reason = next(r.note for r in rows if (r.method, r.schedule) == (method, schedule))
        lines.append(f"{f'{method} {schedule}':<34}not applicable: {reason}")
    lines.append("who wins (ties: less communication first):")
    for n in ns:
        usable = [r for r in rows if r.n == n and r.prediction is not None]
        best = min(usable, key=lambda r: (round(r.prediction.total_s, 9), r.prediction.comm_s))
        base = cell[("allreduce", "", n)].prediction
        if best.method == "allreduce" or best.speedup <= 1.0:
            lines.append(f"  n={n}: All-Reduce is at least as fast as every gossip variant")
        else:
            lines.append(
                f"  n={n}: gossip wins, best {best.method} {best.schedule} {best.speedup:.2f}x "
                f"(All-Reduce comm {1e3 * base.comm_s:.0f} ms vs gossip comm {1e3 * best.prediction.comm_s:.0f} ms)"
            )
    return "\n".join(lines)


_REQUIRED = ("measured_ms", "n", "algorithm", "compute_ms", "model_bytes", "latency_ms", "bandwidth_Bps")


def validation_table(rows: Iterable[Mapping], file: TextIO | None = sys.stdout) -> list[dict]:
    """Predicted vs measured per-iteration time; relative error = (predicted - measured) / measured.

    Each row needs ``_REQUIRED`` keys; optional: schedule (name or degree; needed for gossip), message_bytes,
    compute_cv, optimizer_ms, overlap, local_size, intra_latency_ms, intra_bandwidth_Bps, label,
    allreduce_algorithm ("ring" for Gloo; default "best").
    Returns the rows with ``predicted_ms`` and ``relative_error`` added; prints them if ``file``.
    """
    out = []
    for index, row in enumerate(rows):
        missing = [k for k in _REQUIRED if k not in row]
        if missing:
            raise RuntimeModelError(f"validation row {index} misses key(s) {missing}; it has {sorted(row)}")
        if row["measured_ms"] <= 0:
            raise RuntimeModelError(f"validation row {index}: measured_ms must be > 0, got {row['measured_ms']!r}")
        intra_latency = row.get("intra_latency_ms")
        network = Network(
            row["latency_ms"] / 1e3,
            row["bandwidth_Bps"],
            None if intra_latency is None else intra_latency / 1e3,
            row.get("intra_bandwidth_Bps"),
            row.get("local_size", 1),
        )
        try:
            predicted = predict_iteration(
                row["compute_ms"] / 1e3,
                network,
                row["model_bytes"],
                row["n"],
                row.get("schedule"),
                row["algorithm"],
                message_bytes=row.get("message_bytes"),
                overlap=row.get("overlap"),
                compute_cv=row.get("compute_cv", 0.0),
                optimizer_s=row.get("optimizer_ms", 0.0) / 1e3,
                allreduce_algorithm=row.get("allreduce_algorithm", "best"),
            )
        except ValueError as err:
            raise RuntimeModelError(f"validation row {index}: {err}") from err
        predicted_ms = 1e3 * predicted.total_s
        error = (predicted_ms - row["measured_ms"]) / row["measured_ms"]
        out.append({**row, "predicted_ms": predicted_ms, "relative_error": error})
    if file is not None:
        print(
            f"{'label':<28}{'algorithm':<12}{'schedule':<22}{'n':>6}{'measured':>11}{'predicted':>11}{'rel err':>9}",
            file=file,
        )
        for r in out:
            print(
                f"{r.get('label', '')!s:<28}{r['algorithm']:<12}{r.get('schedule', '')!s:<22}{r['n']:>6}"
                f"{r['measured_ms']:>11.1f}{r['predicted_ms']:>11.1f}{r['relative_error']:>+9.1%}",
                file=file,
            )
        if out:
            mean_abs = sum(abs(r["relative_error"]) for r in out) / len(out)
            print(f"mean |relative error| {mean_abs:.1%} over {len(out)} rows", file=file)
    return out


def plot_table(rows: Sequence[TableRow], path: str) -> None:
    """Predicted ms per iteration vs n, one line per method (matplotlib imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r.method, r.schedule) for r in rows):
        points = [(r.n, 1e3 * r.prediction.total_s) for r in rows if (r.method, r.schedule) == key and r.prediction]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=" ".join(key).strip())
    ax.set(xscale="log", xlabel="ranks n", ylabel="predicted ms / iteration", title="runtime model (B.5)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _rate_argument(text: str) -> float:
    """A command-line rate in tc(8) notation, in byte/s (the unit of :class:`Network`)."""
    try:
        return parse_rate(text, unit="byte/s")
    except RateError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.runtime_model", description=__doc__.split("\n")[0])
    parser.add_argument("--model-mb", type=float, required=True, help="model size in MB (1e6 bytes)")
    parser.add_argument("--compute-ms", type=float, required=True, help="mean forward+backward time per rank")
    parser.add_argument(
        "--bandwidth",
        type=_rate_argument,
        required=True,
        help="inter-node uplink per node in tc(8) units: 1gbit is 1e9 bit/s, 1gbps is 1e9 byte/s",
    )
    parser.add_argument("--latency-ms", type=float, required=True, help="one-way inter-node latency")
    parser.add_argument("--cv", type=float, default=0.0, help="coefficient of variation of compute time")
    parser.add_argument("--optimizer-ms", type=float, default=0.0, help="optimizer (+ mixing) time per step")
    parser.add_argument("--local-size", type=int, default=1, help="ranks per node (AER/hierarchical need >= 2)")
    parser.add_argument(
        "--intra-bandwidth", type=_rate_argument, default=None, help="intra-node link, tc(8) units as --bandwidth"
    )
    parser.add_argument("--intra-latency-ms", type=float, default=None)
    parser.add_argument("--layer-width", type=int, default=1024, help="square layers assumed for PowerGossip")
    parser.add_argument("--pg-rank", type=int, default=1, help="PowerGossip rank")
    parser.add_argument("--allreduce", choices=("best", "ring"), default="best", help="All-Reduce algorithm")
    parser.add_argument("--ns", type=int, nargs="+", default=list(DEFAULT_NS))
    parser.add_argument("--plot", default=None, help="write a PNG plot to this path")
    args = parser.parse_args(argv)
    try:
        network = Network(
            args.latency_ms / 1e3,
            args.bandwidth,
            None if args.intra_latency_ms is None else args.intra_latency_ms / 1e3,
            args.intra_bandwidth,
            args.local_size,
        )
        model_bytes = args.model_mb * 1e6
        shapes = synthetic_param_shapes(model_bytes, args.layer_width)
        rows = predict_table(
            model_bytes,
            args.compute_ms / 1e3,
            network,
            ns=args.ns,
            powergossip_bytes=powergossip_bytes_per_peer(shapes, args.pg_rank),
            compute_cv=args.cv,
            optimizer_s=args.optimizer_ms / 1e3,
            allreduce_algorithm=args.allreduce,
        )
    except ValueError as err:
        parser.error(str(err))
    if args.plot:
        plot_table(rows, args.plot)
