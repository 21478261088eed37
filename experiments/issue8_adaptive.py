"""Issue 8 / GraVAC (algorithms.md C.4): adaptive PowerGossip rank vs fixed ranks, i.i.d. and non-i.i.d.

4 workers (simulator), gossip.gpt's GPT on the stdlib corpus, one-peer hypercube. The controller decides every
``--every`` steps (throughput = measured step time of the in-process run, so with no network cost it is nearly
flat across ranks and the gain term decides). Writes experiments/results/issue8_adaptive.csv and
issue8_adaptive.md: bytes and steps (and simulator seconds) until the validation loss reaches a target.
Run: PYTHONPATH=. python experiments/issue8_adaptive.py [--steps 150 --every 20]
"""

from __future__ import annotations

import argparse

import gossip
from experiments.issue8_common import RESULTS, first_reaching, train_run, write_csv
from gossip.algorithms.adaptive_rank import AdaptivePowerGossip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--splits", nargs="+", default=["iid", "noniid"], choices=["iid", "noniid"])
    args = parser.parse_args()
    methods = {f"powergossip r={r}": (lambda r=r: gossip.PowerGossip(rank=r)) for r in args.ranks}
    methods["adaptive (1,2,4,8)"] = lambda: AdaptivePowerGossip(ladder=(1, 2, 4, 8), every=args.every, alpha=0.2)
    rows = []
    for split in args.splits:
        for method, factory in methods.items():
            for row in train_run(factory, steps=args.steps, split=split, eval_every=10):
                rows.append({"split": split, "method": method, **row})
                print(split, method, row, flush=True)
    write_outputs(rows, args.steps, args.every)


def write_outputs(rows: list[dict], steps: int, every: int) -> None:
    """CSV of every evaluation row, and per split a table of steps, bytes and seconds to a common target loss."""
    write_csv(RESULTS / "issue8_adaptive.csv", rows)
    lines = [f"# Issue 8: adaptive PowerGossip rank ({steps} steps, 4 workers, decision every {every})", ""]
    for split in dict.fromkeys(r["split"] for r in rows):
        methods = dict.fromkeys(r["method"] for r in rows if r["split"] == split)
        runs = {m: [r for r in rows if r["split"] == split and r["method"] == m] for m in methods}
        target = max(run[-1]["val_loss"] for run in runs.values()) + 0.02  # reached by every run
        lines += [
            f"## {split}: target validation loss {target:.3f} (worst final loss + 0.02)",
            "",
            "| method | steps to target | bytes/worker to target | sim. seconds to target | final val loss | "
            "total bytes/worker | ranks used (per evaluation) |",
            "|---|---|---|---|---|---|---|",
        ]
        for method, run in runs.items():
            hit = first_reaching(run, target)
            ranks = ",".join(str(r["rank"]) for r in run)
            lines.append(
                f"| {method} | {hit['step']} | {hit['bytes_per_worker']:,.0f} | {hit['seconds']:.1f} | "
                f"{run[-1]['val_loss']:.4f} | {run[-1]['bytes_per_worker']:,.0f} | {ranks} |"
            )
        lines.append("")
    (RESULTS / "issue8_adaptive.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
