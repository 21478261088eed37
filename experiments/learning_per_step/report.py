r"""Tables and plots of the learning-per-step study from the CSVs :mod:`experiments.learning_per_step` writes.

``python -m experiments.learning_per_step.report --dir experiments/learning_per_step/results/sweep_16core`` prints, as
Markdown:

* per configuration (mean ± sample standard deviation over its seeds): final training loss (mean over ranks and
  the last 50 steps), its gap to the DDP run of the same size and length (paired by seed), the validation loss of
  the averaged model, the exact consensus distance (at the end; and the mean over the records of the second half, as
  periodic averaging makes it a saw-tooth), bytes per worker per step and DDP's bytes / these bytes,
  and the steps to DDP's final training loss (first recorded 10-step block at or below the mean of DDP's final
  losses over seeds; ``k/n`` seeds reached it);
* the spectrum of the replica differences: best rank-r energy shares, stable rank, and what PowerGossip's own
  factor captured (``pg_captured``), mean over seeds;

and draws ``consensus_over_time.png`` and ``loss_over_steps.png`` into ``--dir`` (the first, when several are
given: their runs are read together, each (configuration, seed) from the first directory that has it, so new
configurations can be paired with DDP runs committed earlier on the same machine). The columns and plots that need
the per-step records (``steps.csv``: steps to DDP's loss, consensus over the second half) show ``–`` where a
directory holds only the summaries, as the committed results do: the records come back with a re-run of the
configurations.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from experiments.learning_per_step.study import RESULTS


def read_rows(path: Path) -> list[dict]:
    """Rows of a CSV, numbers as float where they parse, empty file -> []."""
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key, text in row.items():
            with contextlib.suppress(TypeError, ValueError):
                row[key] = float(text)
    return rows


def merged_rows(directories: Sequence[Path], name: str) -> list[dict]:
    """The rows of ``<directory>/<name>.csv`` over ``directories``; the runs of a (configuration, seed) come from the
    first directory that has them (a run repeated in a later directory, e.g. to check it reproduces, is not counted
    twice).

    Args:
        directories: result directories, in order of precedence.
        name: ``summary``, ``steps`` or ``spectrum``.

    Returns:
        The rows, those of the first directory first.
    """
    rows: list[dict] = []
    taken: set[tuple] = set()
    for directory in directories:
        mine = read_rows(directory / f"{name}.csv")
        runs = {(row["config"], row["seed"]) for row in mine}
        rows += [row for row in mine if (row["config"], row["seed"]) not in taken]
        taken |= runs
    return rows


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def is_ddp(row: dict) -> bool:
    """Whether a summary row is a DDP run: its settings (``RunConfig.describe``) say ``algorithm=ddp``."""
    return "algorithm=ddp" in str(row["settings"]).split(", ")


def reference_of(config: str, summary: list[dict], named: str | None = None) -> str | None:
    """The configuration ``config`` is compared with: ``named`` if given and run with as many workers, else the DDP
    configuration of the same number of workers and steps (``ddp`` or ``mj-ddp`` first, else the only DDP
    configuration of that size and length; none where several are and none is so named), if it ran."""
    mine = next(r for r in summary if r["config"] == config)
    if named is not None:
        return named if any(r["config"] == named and r["workers"] == mine["workers"] for r in summary) else None
    alike = {
        r["config"] for r in summary if is_ddp(r) and r["workers"] == mine["workers"] and r["steps"] == mine["steps"]
    }
    for name in ("ddp", "mj-ddp"):
        if name in alike:
            return name
    return alike.pop() if len(alike) == 1 else None


def steps_to_target(curve: Sequence[tuple[float, float]], target: float) -> float:
    """First step of ``curve`` ((step, loss) pairs in step order) whose loss is <= target; nan if none."""
    return next((step for step, loss in curve if loss <= target), math.nan)


def config_table(summary: list[dict], steps: list[dict], reference: str | None = None) -> list[dict]:
    """One aggregated row per configuration, in the order the configurations first appear.

    Gaps and steps to the target are against the DDP run of the same workers and steps, or, with ``reference``,
    against that configuration for every configuration of its number of workers, whatever their step budgets
    (the time-to-loss question: a budget of its own for each method, DDP's final loss as the target).
    """
    by_config: dict[str, list[dict]] = defaultdict(list)
    for row in summary:
        by_config[row["config"]].append(row)
    curves: dict[tuple[str, float], list[tuple[float, float]]] = defaultdict(list)
    late_consensus: dict[str, list[float]] = defaultdict(list)  # per configuration, over seeds and records
    for row in steps:
        curves[(row["config"], row["seed"])].append((row["step"], row["train_loss"]))
    length = {r["config"]: r["steps"] for r in summary}
    recorded = {row["config"] for row in steps}  # configurations with per-step records (steps.csv)
    for row in steps:
        if row["config"] in length and row["step"] > length[row["config"]] / 2:
            late_consensus[row["config"]].append(row["consensus"])
    table = []
    for config, runs in by_config.items():
        compared_with = reference_of(config, summary, reference)
        ref_runs = {r["seed"]: r for r in by_config.get(compared_with, [])}
        gaps = [r["final_train_loss"] - ref_runs[r["seed"]]["final_train_loss"] for r in runs if r["seed"] in ref_runs]
        target = statistics.fmean(r["final_train_loss"] for r in ref_runs.values()) if ref_runs else math.nan
        reached = [steps_to_target(sorted(curves[(config, r["seed"])]), target) for r in runs]
        hits = [s for s in reached if not math.isnan(s)]
        bytes_per_step = statistics.fmean(r["bytes_per_worker_per_step"] for r in runs)
        ddp_bytes = runs[0]["ddp_bytes_per_worker_per_step"]
        table.append(
            {
                "config": config,
                "settings": runs[0]["settings"],
                "seeds": len(runs),
                "workers": int(runs[0]["workers"]),
                "steps": int(runs[0]["steps"]),
                "train": mean_std([r["final_train_loss"] for r in runs]),
                "gap": mean_std(gaps),
                "val": mean_std([r["val_loss_averaged"] for r in runs]),
                "consensus": mean_std([r["final_consensus"] for r in runs]),
                "late_consensus": statistics.fmean(late_consensus[config]) if late_consensus[config] else math.nan,
                "bytes": bytes_per_step,
                "ddp_over_bytes": ddp_bytes / bytes_per_step if bytes_per_step else math.inf,
                "to_target": (len(hits), len(runs), statistics.fmean(hits) if hits else math.nan),
                "recorded": config in recorded,
                "reference": compared_with,
            }
        )  # fmt: skip
    return table


def _pm(pair: tuple[float, float], digits: int = 3) -> str:
    mean, std = pair
    return "–" if math.isnan(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_configs(table: list[dict]) -> str:
    lines = [
        "| configuration | n, steps | seeds | final train loss | gap to DDP (paired) | val loss, averaged model "
        "| consensus distance (final; mean over 2nd half) | bytes/worker/step | DDP bytes ÷ "
        "| seeds reaching DDP's final loss, mean steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        hits, runs, mean_steps = row["to_target"]
        reach = f"{hits}/{runs}" + (f", {mean_steps:.0f}" if hits else "")
        late = f"{row['late_consensus']:.2f}" if row["recorded"] else "–"
        ratio = "–" if math.isinf(row["ddp_over_bytes"]) else f"{row['ddp_over_bytes']:.1f}"
        lines.append(
            f"| `{row['config']}` | {row['workers']}, {row['steps']} | {row['seeds']} | {_pm(row['train'])} "
            f"| {_pm(row['gap'])} | {_pm(row['val'])} | {_pm(row['consensus'], 2)}; {late} "
            f"| {row['bytes'] / 1e3:,.1f} kB "
            f"| {ratio} | {reach if row['reference'] and row['recorded'] else '–'} |"
        )
    return "\n".join(lines)


def markdown_spectrum(spectrum: list[dict], kind: str) -> str:
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for row in spectrum:
        if row["kind"] == kind:
            groups[(row["config"], row["step"])].append(row)
    has_pg = any(not math.isnan(r.get("pg_captured", math.nan) or math.nan) for r in spectrum if r["kind"] == kind)
    header = "| configuration | step | seeds | ‖D‖_F | best rank-1 share | rank-4 | rank-16 | stable rank |"
    lines = [header + (" PowerGossip's factor captured |" if has_pg else ""), "|---" * (8 + has_pg) + "|"]
    for (config, step), rows in groups.items():
        cells = [f"`{config}`", f"{step:.0f}", str(len(rows)), _pm(mean_std([r["norm"] for r in rows]), 2)]
        cells += [_pm(mean_std([r[f"share_r{k}"] for r in rows]), 2) for k in (1, 4, 16)]
        cells.append(_pm(mean_std([r["stable_rank_mean"] for r in rows]), 1))
        if has_pg:
            cells.append(_pm(mean_std([r["pg_captured"] for r in rows]), 3))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(steps: list[dict], configs: Sequence[str], key: str, path: Path, log: bool) -> Path:
    """Mean over seeds of ``key`` against the step, one line per configuration, with the seeds' min-max band."""
    from experiments.shared import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for config in configs:
        by_step: dict[float, list[float]] = defaultdict(list)
        for row in steps:
            if row["config"] == config:
                by_step[row["step"]].append(row[key])
        xs = sorted(by_step)
        if not xs:
            continue
        mean = [statistics.fmean(by_step[x]) for x in xs]
        (line,) = ax.plot(xs, mean, label=config, linewidth=1.2)
        ax.fill_between(xs, [min(by_step[x]) for x in xs], [max(by_step[x]) for x in xs], alpha=0.15,
                        color=line.get_color())  # fmt: skip
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(key.replace("_", " "))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        nargs="+",
        default=[RESULTS],
        help="result directories (plots go to the first); a (configuration, seed) in several is read from the first",
    )
    parser.add_argument("--plot", nargs="*", default=None, help="configurations to plot (default: the n = 8 ones)")
    parser.add_argument(
        "--reference", default=None, help="compare every configuration with this one (default: DDP of equal steps)"
    )
    args = parser.parse_args(argv)
    summary, steps, spectrum = (merged_rows(args.dir, name) for name in ("summary", "steps", "spectrum"))
    if not summary:
        parser.error(f"no summary.csv in {args.dir}")
    out = args.dir[0]
    print(markdown_configs(config_table(summary, steps, args.reference)))
    for kind in ("pair", "to_mean", "next_edge"):
        if any(r["kind"] == kind for r in spectrum):
            print(f"\nSpectrum of the replica difference ({kind}):\n")
            print(markdown_spectrum(spectrum, kind))
    plotted = args.plot
    if plotted is None:
        plotted = [r["config"] for r in config_table(summary, steps) if r["workers"] == 8 and r["steps"] == 1000]
    if plotted and steps:
        print(plot_curves(steps, plotted, "consensus", out / "consensus_over_time.png", log=True))
        print(plot_curves(steps, plotted, "train_loss", out / "loss_over_steps.png", log=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
