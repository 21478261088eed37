"""The gap to DDP along training: an arm's averaged-model validation loss minus its DDP twin's, step by step.

Each ``--pair LABEL ARM DDP`` names two runs (``config`` names of a ``steps.csv``, the sweep's or the ablation's)
that share their seeds, initial models, tokens and learning rates; for every seed both recorded, the gap at step t
is :math:`L_{arm}(t) - L_{DDP}(t)` at the steps both recorded. One panel a pair: each seed's gap, their mean, and
the band of ± ``--target`` (0.03 nats by default).

Run: ``python -m experiments.scale.gap_curves --steps A/steps.csv B/steps.csv --pair "16 x 4" ARM DDP ... --out
results/gap_curves.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from experiments.scale.report import curves
from experiments.shared import pyplot, read_csv, save_figure


def gap_curves(steps: list[dict], arm: str, ddp: str) -> dict[int, list[tuple[int, float]]]:
    """Per seed, ``[(step, arm - DDP), ...]`` at the steps both runs recorded, in step order.

    Args:
        steps: ``steps.csv`` rows (:func:`experiments.shared.read_csv`), any number of runs.
        arm: the arm's ``config``.
        ddp: its DDP twin's ``config``.

    Returns:
        ``{seed: [(step, gap), ...]}`` for the seeds both runs have.

    Raises:
        ValueError: the runs share no seed (a misspelt name, or runs not from the same seeds).
    """
    runs = curves(steps)
    seeds = sorted({seed for config, seed in runs if config == arm} & {s for c, s in runs if c == ddp})
    if not seeds:
        raise ValueError(f"no seed recorded for both {arm!r} and {ddp!r}")
    out = {}
    for seed in seeds:
        mine, theirs = ({int(r["step"]): r["avg_val_loss"] for r in runs[config, seed]} for config in (arm, ddp))
        out[int(seed)] = [(step, mine[step] - theirs[step]) for step in sorted(mine.keys() & theirs.keys())]
    return out


def plot(panels: list[tuple[str, dict[int, list[tuple[int, float]]]]], target: float, path: Path) -> Path:
    """One panel per pair: each seed's gap (thin), the mean over seeds (thick), and the band of ± ``target``.

    Args:
        panels: ``[(label, gap_curves(...)), ...]``.
        target: the band's half-width, in nats.
        path: the PNG to write.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False, sharey=True)
    for ax, (label, seeds) in zip(axes[0], panels, strict=True):
        for seed, curve in seeds.items():
            ax.plot(*zip(*curve, strict=True), lw=0.7, label=f"seed {seed}")
        by_step = [dict(curve) for curve in seeds.values()]
        common = sorted(set.intersection(*(set(gaps) for gaps in by_step)))
        mean = [statistics.mean(gaps[step] for gaps in by_step) for step in common]
        ax.plot(common, mean, color="black", lw=2, label=f"mean of {len(seeds)}")
        ax.axhspan(-target, target, color="C2", alpha=0.12, label=f"± {target}")
        ax.axhline(0, color="grey", lw=0.6)
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("val. loss, averaged model − DDP's")
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.scale.gap_curves``: each pair's gap curves, their final values printed, one figure.

    Args:
        argv: the command's arguments; None reads ``sys.argv[1:]``.

    Returns:
        0 once the figure is written.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=Path, nargs="+", required=True, help="steps.csv files")
    parser.add_argument("--pair", nargs=3, action="append", required=True, metavar=("LABEL", "ARM", "DDP"))
    parser.add_argument("--target", type=float, default=0.03)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = [row for path in args.steps for row in read_csv(path)]
    panels = []
    for label, arm, ddp in args.pair:
        seeds = gap_curves(rows, arm, ddp)
        final = [curve[-1][1] for curve in seeds.values()]
        print(f"{label}: {len(seeds)} seeds, final gap " + " / ".join(f"{gap:+.3f}" for gap in final))
        panels.append((label, seeds))
    print(plot(panels, args.target, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
