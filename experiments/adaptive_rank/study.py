"""Issue 8 / GraVAC (docs/design.md C.4): adaptive PowerGossip rank vs fixed ranks, i.i.d. and non-i.i.d.

4 workers (simulator), gossip.app.gpt's GPT on the stdlib corpus, one-peer hypercube. The controller decides every
``--every`` steps (throughput = measured step time of the in-process run, so with no network cost it is nearly
flat across ranks and the gain term decides). Writes experiments/adaptive_rank/results/adaptive.csv (every evaluation),
adaptive_decisions.csv (the controller's gain / throughput / CT per decision), adaptive.md (per
split: steps, bytes and simulator seconds until the validation loss reaches a common target) and
adaptive.png (validation loss vs cumulative bytes).
Run: python -m experiments.adaptive_rank [--steps 150 --every 20 --seeds 0 1 2]
     python -m experiments.adaptive_rank --plot-only   (redraw the PNG from the CSV)
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import gossip
from experiments.shared import first_reaching, pyplot, read_csv, save_figure, train_run, write_csv
from gossip.algorithms.adaptive_rank import AdaptivePowerGossip

RESULTS = Path(__file__).resolve().parent / "results"
CSV, DECISIONS = RESULTS / "adaptive.csv", RESULTS / "adaptive_decisions.csv"
TABLE, PLOT = RESULTS / "adaptive.md", RESULTS / "adaptive.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--splits", nargs="+", default=["iid", "noniid"], choices=["iid", "noniid"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--plot-only", action="store_true", help="only redraw adaptive.png from the CSV")
    args = parser.parse_args()
    if args.plot_only:
        print(plot(read_csv(CSV)))
        return
    methods = {f"powergossip r={r}": (lambda r=r: gossip.PowerGossip(rank=r)) for r in args.ranks}
    methods["adaptive (1,2,4,8)"] = lambda: AdaptivePowerGossip(ladder=(1, 2, 4, 8), every=args.every, alpha=0.2)
    rows, decisions = [], []
    for split in args.splits:
        for seed in args.seeds:
            for method, factory in methods.items():
                key = {"split": split, "seed": seed, "method": method}

                def keep_history(algorithm: gossip.Algorithm, key=key) -> None:
                    decisions.extend({**key, **entry} for entry in getattr(algorithm, "history", []))

                for row in train_run(factory, steps=args.steps, split=split, eval_every=10, seed=seed,
                                     on_finish=keep_history):  # fmt: skip
                    rows.append({**key, **row})
                    print(split, seed, method, row, flush=True)
    write_csv(CSV, rows)
    write_csv(DECISIONS, decisions)
    write_table(rows, args.steps, args.every)
    print(plot(rows))


def trajectory(run: list[dict]) -> str:
    """Rank changes over the evaluations, as 'rank@first step seen': 1@10 2@20 4@40 8@60."""
    changes = [row for k, row in enumerate(run) if k == 0 or row["rank"] != run[k - 1]["rank"]]
    return " ".join(f"{int(row['rank'])}@{int(row['step'])}" for row in changes)


def write_table(rows: list[dict], steps: int, every: int) -> None:
    """Per split: steps / bytes / seconds to a common target loss, final loss, rank trajectory, over seeds."""
    seeds = sorted({int(r["seed"]) for r in rows})
    lines = [
        f"# Issue 8: adaptive PowerGossip rank ({steps} steps, 4 workers, decision every {every}, "
        f"seeds {', '.join(map(str, seeds))})",
        "",
    ]
    for split in dict.fromkeys(r["split"] for r in rows):
        runs: dict[str, dict[int, list[dict]]] = {}
        for r in rows:
            if r["split"] == split:
                runs.setdefault(r["method"], {}).setdefault(int(r["seed"]), []).append(r)
        target = max(run[-1]["val_loss"] for per_seed in runs.values() for run in per_seed.values()) + 0.02
        lines += [
            f"## {split}: target validation loss {target:.3f} (worst final loss over methods and seeds + 0.02)",
            "",
            "| method | steps to target (per seed) | bytes/worker to target (mean) | sim. seconds to target (mean) | "
            "final val loss (mean; min-max) | total bytes/worker | rank trajectory (rank@step, per seed) |",
            "|---|---|---|---|---|---|---|",
        ]
        for method, per_seed in runs.items():
            hits = [first_reaching(run, target) for run in per_seed.values()]
            finals = [run[-1]["val_loss"] for run in per_seed.values()]
            total = statistics.mean(run[-1]["bytes_per_worker"] for run in per_seed.values())
            lines.append(
                f"| {method} | {' / '.join(str(int(h['step'])) for h in hits)} | "
                f"{statistics.mean(h['bytes_per_worker'] for h in hits):,.0f} | "
                f"{statistics.mean(h['seconds'] for h in hits):.1f} | "
                f"{statistics.mean(finals):.4f}; {min(finals):.4f}-{max(finals):.4f} | {total:,.0f} | "
                f"{' / '.join(trajectory(run) for run in per_seed.values())} |"
            )
        lines.append("")
    TABLE.write_text("\n".join(lines))
    print("\n".join(lines))


def plot(rows: list[dict]):
    """Validation loss vs cumulative bytes per worker, one panel per split, one colour per method."""
    plt = pyplot()
    splits = list(dict.fromkeys(r["split"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 3.8), sharey=True, squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        for colour, method in enumerate(methods):
            for seed in sorted({r["seed"] for r in rows}):
                run = [r for r in rows if r["split"] == split and r["method"] == method and r["seed"] == seed]
                first = seed == min(r["seed"] for r in rows)
                style = {"alpha": 1.0, "lw": 1.5, "label": method} if first else {"alpha": 0.35, "lw": 0.8}
                ax.plot([r["bytes_per_worker"] for r in run], [r["val_loss"] for r in run], color=f"C{colour}", **style)
        ax.set(xscale="log", xlabel="bytes sent per worker (cumulative)", ylim=(2.5, 3.4))
        ax.set_title(f"{split} split (bold: seed 0; faint: other seeds)", fontsize=10)
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, PLOT)


if __name__ == "__main__":
    main()
