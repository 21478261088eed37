"""The sweeps' tables and plot from their records: each arm against DDP on the same n, batch and seed.

For every run in ``summary.csv`` with a DDP twin (same workers, batch, steps, warm-up and seed: the same initial
model, tokens and learning rates),
:func:`gaps` gives the paired gap of the final averaged-model validation loss, arm - DDP, and the DDP-equivalent
steps: the first recorded step at which DDP's averaged validation loss is at or below the arm's final one
(``steps.csv``, every ``record_every`` steps), so that the arm's steps over it bounds from below the steps ratio the
arm needs to reach DDP's final loss on the same schedule (``None`` when DDP's curve never gets that high, the arm
ending below DDP, or when ``steps.csv`` has no curve of the twin: ``ddp_curve_points`` tells which). :func:`plot`
draws the averaged model's validation loss against steps, one panel per (n, batch, warm-up).

Run: ``python -m experiments.scale.report`` (reads and writes ``experiments/scale/results/``; without ``steps.csv``,
which is not committed, it prints the table and leaves ``gaps.csv`` and the plot as they are).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from experiments.scale.study import RESULTS
from experiments.shared import pyplot, read_csv, save_figure, write_csv


def _arm(config: str) -> str:
    """``[prefix-]n16-b4-pipeline[-ring][-s500][-warmup30]`` -> ``pipeline[-ring]`` (the steps and the warm-up are
    ``summary.csv``'s columns)."""
    return re.fullmatch(r"(?:.+-)?n\d+-b\d+-(.+?)(?:-s\d+)?(?:-warmup\d+)?", config).group(1)


def curves(steps: list[dict]) -> dict[tuple, list[dict]]:
    """``steps.csv``'s rows per run, in step order.

    Args:
        steps: ``steps.csv``'s rows.

    Returns:
        ``{(config, seed): rows}``.
    """
    runs: dict[tuple, list[dict]] = {}
    for row in sorted(steps, key=lambda r: r["step"]):
        runs.setdefault((row["config"], row["seed"]), []).append(row)
    return runs


def gaps(summary: list[dict], steps: list[dict]) -> list[dict]:
    """One row per (workers, batch, steps, warm-up, arm, seed) that has a DDP twin.

    Args:
        summary: ``summary.csv``'s rows (:func:`experiments.shared.read_csv`).
        steps: ``steps.csv``'s rows.

    Returns:
        Rows with ``gap`` (arm - DDP, final averaged validation loss), ``ddp_equivalent_step`` and
            ``steps_ratio_at_least`` (the arm's steps over it), the final consensus distance and bytes per step.
    """

    def twin_key(row: dict) -> tuple:
        return row["workers"], row["batch"], row["step"], row["warmup"], row["seed"]

    ddp = {twin_key(r): r for r in summary if _arm(r["config"]) == "ddp"}
    runs = curves(steps)
    out = []
    for row in summary:
        key = twin_key(row)
        if _arm(row["config"]) == "ddp" or key not in ddp:
            continue
        twin = ddp[key]
        final = row["final_avg_val_loss"]
        curve = runs.get((twin["config"], twin["seed"]), [])
        reached = next((int(r["step"]) for r in curve if r["avg_val_loss"] <= final), None)
        out.append({
            "workers": int(row["workers"]), "batch": int(row["batch"]), "warmup": int(row["warmup"]),
            "arm": _arm(row["config"]),
            "seed": int(row["seed"]), "steps": int(row["step"]), "final_avg_val_loss": final,
            "ddp_final_avg_val_loss": twin["final_avg_val_loss"], "gap": final - twin["final_avg_val_loss"],
            "local_minus_avg": row["final_local_val_loss"] - final, "final_consensus": row["final_consensus"],
            "ddp_equivalent_step": reached, "steps_ratio_at_least": row["step"] / reached if reached else None,
            "ddp_curve_points": len(curve),
            "bytes_per_step_over_ddp": row["bytes_per_worker_per_step"] / twin["bytes_per_worker_per_step"],
        })  # fmt: skip
    return sorted(out, key=lambda r: (r["workers"], r["batch"], r["steps"], r["warmup"], r["arm"], r["seed"]))


def equivalent_step_text(row: dict) -> str:
    """A :func:`gaps` row's DDP-equivalent step as the table prints it.

    Args:
        row: the row.

    Returns:
        The step, ``"ends below DDP"`` when DDP's curve never reaches the arm's final loss, or ``"no DDP curve"``
            when ``steps.csv`` has none for the twin (its rows are not committed: the run writes them again).
    """
    if row["ddp_equivalent_step"] is not None:
        return str(row["ddp_equivalent_step"])
    return "ends below DDP" if row["ddp_curve_points"] else "no DDP curve"


def mean_spread(values: list[float]) -> str:
    """``mean ± sd (k seeds)``, or the value and ``(1 seed)``.

    Args:
        values: one value per seed.

    Returns:
        The text.
    """
    if len(values) == 1:
        return f"{values[0]:+.3f} (1 seed)"
    return f"{statistics.mean(values):+.3f} ± {statistics.stdev(values):.3f} ({len(values)} seeds)"


def plot(steps: list[dict], path: Path) -> Path:
    """The averaged model's validation loss against steps, one panel per (workers, batch, warm-up): every run and
    seed that ``steps.csv`` has, one colour per arm and one line style per seed.

    Args:
        steps: ``steps.csv``'s rows.
        path: the PNG to write.

    Returns:
        ``path``.
    """
    plt = pyplot()
    styles = ("-", "--", ":", "-.")
    panels = sorted({(int(r["workers"]), int(r["batch"]), int(r["warmup"])) for r in steps})
    arms = sorted({_arm(r["config"]) for r in steps})
    colours = {arm: f"C{i}" for i, arm in enumerate(arms)}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    runs = curves(steps)
    for ax, (n, b, warmup) in zip(axes[0], panels, strict=True):
        for (config, seed), rows in sorted(runs.items()):
            if (int(rows[0]["workers"]), int(rows[0]["batch"]), int(rows[0]["warmup"])) != (n, b, warmup):
                continue
            arm = _arm(config)
            ax.plot([r["step"] for r in rows], [r["avg_val_loss"] for r in rows], label=f"{arm}, seed {int(seed)}",
                    color=colours[arm], linestyle=styles[int(seed) % len(styles)], lw=1.1)  # fmt: skip
        title = f"n = {n}, {b} sequences a worker, {warmup} warm-up steps"
        ax.set(title=title, xlabel="step", ylabel="val. loss, averaged model")
        ax.set_ylim(top=2.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """The command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    curves_path = args.results / "steps.csv"  # not committed: the runs write it
    if not (args.results / "summary.csv").exists():
        parser.error(f"no summary.csv in {args.results} (python -m experiments.scale --out {args.results} writes it)")
    summary, steps = read_csv(args.results / "summary.csv"), read_csv(curves_path) if curves_path.exists() else []
    rows = gaps(summary, steps)
    if not rows:
        parser.error(f"{args.results / 'summary.csv'}: no run has a DDP twin (same n, batch, steps, warm-up, seed)")
    if steps:  # without the curves, gaps.csv keeps the DDP-equivalent steps it was written with
        write_csv(args.results / "gaps.csv", rows)
    print("| n × sequences | steps | warm-up | arm | gap to DDP | DDP-equivalent step | consensus | bytes ÷ DDP's |")
    print("|---|---|---|---|---|---|---|---|")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workers"], row["batch"], row["steps"], row["warmup"], row["arm"]), []).append(row)
    for (n, b, steps_run, warmup, arm), group in groups.items():
        equivalent = " / ".join(equivalent_step_text(r) for r in group)
        consensus = " / ".join(f"{r['final_consensus']:.2f}" for r in group)
        gap = mean_spread([r["gap"] for r in group])
        print(f"| {n} × {b} | {steps_run} | {warmup} | {arm} | {gap} | {equivalent} | {consensus} | "
              f"{group[0]['bytes_per_step_over_ddp']:.3f} |")  # fmt: skip
    if steps:
        print(plot(steps, args.results / "validation_loss.png"))
    else:
        print(f"no {curves_path} (the runs write it): no DDP-equivalent steps, gaps.csv and the plot left as they are")
    return 0


if __name__ == "__main__":
    sys.exit(main())
