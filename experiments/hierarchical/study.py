"""Issue 8 / hierarchical gossip (docs/design.md E.2) on an emulated two-level network: 2 nodes x 2 ranks.

Each emulated node is one network namespace of experiments/netem holding BOTH of its ranks: ranks of a node talk
over that namespace's loopback route (kernel speed, the fast level), ranks of different nodes over the
rate-limited veth link (``--rate``, the slow level; htb on each namespace's uplink and downlink). Every rank
times ``--steps`` mixing steps (no compute, so the communication is fully exposed) of All-Reduce, flat exact
gossip and flat PowerGossip on the one-peer hypercube over the 4 ranks, and hierarchical gossip (exact and
PowerGossip r=4 across nodes). Needs root. Writes experiments/hierarchical/results/hierarchical.{csv,md}.
Also draws hierarchical.png (seconds per step per method).
Run: python -m experiments.hierarchical [--rate 100mbit --size 512 --layers 8]
     python -m experiments.hierarchical --plot-only   (redraw the PNG from the CSV)
     python -m experiments.hierarchical --validate    (runtime model vs the CSV)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.netem import EmulatedNetwork
from experiments.netem.launch import supervise
from experiments.netem.network import python_path_env
from experiments.rates import parse_rate
from experiments.runtime_model.cli import validation_table
from experiments.shared import pyplot, read_csv, save_figure, write_csv

RESULTS = Path(__file__).resolve().parent / "results"

NODES, PER_NODE = 2, 2
NOTES = """
Reading: per node, hierarchical exact gossip and flat one-peer-hypercube gossip move the same inter-node volume
per step on average for L = 2 (M per node per step; flat does 2M every other step and 0 in between), but the
hierarchical step reaches the exact global average every log2(N) = 1 step here. Hierarchical PowerGossip sends
(L-1)/L M twice over the fast level (reduce-scatter + all-gather, uncompressed) plus the compressed factors across
nodes, so on this machine (2 shared cores, loopback limited by CPU) it is slower than flat PowerGossip, which sends
only factors; its bytes column counts both levels. One run per method; the README gives three repeats.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", default="100mbit", help="inter-node rate per node (tc syntax)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=512, help="each layer is a size x size float32 matrix")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--plot-only", action="store_true", help="only redraw hierarchical.png from the CSV")
    parser.add_argument("--validate", action="store_true", help="only compare the runtime model with the CSV")
    args = parser.parse_args()
    if args.plot_only:
        print(plot(read_csv(RESULTS / "hierarchical.csv")))
        return
    if args.validate:
        validate(read_csv(RESULTS / "hierarchical.csv"))
        return
    worker = Path(__file__).resolve().parent / "worker.py"
    with tempfile.TemporaryDirectory() as out, EmulatedNetwork(hosts=NODES, rate=args.rate) as net:
        base = python_path_env()
        processes, prefixes = [], []
        for node in range(NODES):
            for local in range(PER_NODE):
                rank = node * PER_NODE + local
                env = dict(base, RANK=str(rank), WORLD_SIZE=str(NODES * PER_NODE), LOCAL_RANK=str(local),
                           LOCAL_WORLD_SIZE=str(PER_NODE), MASTER_ADDR=net.address(0), MASTER_PORT="29517",
                           GLOO_SOCKET_IFNAME=net.device, TP_SOCKET_IFNAME=net.device, OMP_NUM_THREADS="1")  # fmt: skip
                argv = [sys.executable, str(worker), out, str(args.steps), str(args.size), str(args.layers)]
                processes.append(
                    net.popen(node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                )
                prefixes.append(f"[{rank}] ")
        code = supervise(processes, prefixes, 900.0, lambda line: print(line, end="", flush=True))
        if code:
            raise SystemExit(f"workers failed with exit code {code}")
        per_rank = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(NODES * PER_NODE)]
    model_bytes = args.size * args.size * args.layers * 4
    rows = []
    for method in per_rank[0]:
        seconds = max(r[method]["seconds_per_step"] for r in per_rank)
        sent = sum(r[method]["bytes_per_step"] for r in per_rank) / len(per_rank)
        rows.append({"method": method, "rate": args.rate, "model_bytes": model_bytes, "seconds_per_step": seconds,
                     "bytes_sent_per_rank_per_step": sent})  # fmt: skip
    write_csv(RESULTS / "hierarchical.csv", rows)
    lines = [
        f"# Issue 8: hierarchical gossip on 2 emulated nodes x 2 ranks (inter-node {args.rate}, intra-node loopback)",
        "",
        f"Model: {args.layers} float32 matrices {args.size}x{args.size} ({model_bytes / 1e6:.1f} MB); "
        f"{args.steps} timed mixing steps, no compute (communication fully exposed); slowest rank.",
        "",
        "| method | seconds per step | bytes sent per rank per step (all levels) |",
        "|---|---|---|",
        *[f"| {r['method']} | {r['seconds_per_step']:.3f} | {r['bytes_sent_per_rank_per_step']:,.0f} |" for r in rows],
    ]
    (RESULTS / "hierarchical.md").write_text("\n".join(lines) + "\n" + NOTES)
    print("\n".join(lines))
    print(plot(rows))


def plot(rows: list[dict]):
    """Horizontal bars: seconds per mixing step of each method (slowest rank), log scale."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    names = [row["method"] for row in rows]
    seconds = [row["seconds_per_step"] for row in rows]
    bars = ax.barh(names, seconds, color=[f"C{k}" for k in range(len(rows))])
    ax.bar_label(bars, labels=[f"{s:.3f} s" for s in seconds], fontsize=8, padding=2)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="seconds per mixing step (no compute; slowest rank)", xlim=(0.01, 10))
    ax.set_title(f"2 emulated nodes x 2 ranks: inter-node {rows[0]['rate']}, intra-node loopback", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    return save_figure(fig, RESULTS / "hierarchical.png")


# Link parameters of the emulation (kernel path, no added delay) from docs/design.md J: Gloo over
# loopback 60-125 us small-message latency and 2-4.5 GB/s; the htb rate as set. No compute in the timed loop.
LOOPBACK_LATENCY_MS, LOOPBACK_BPS = 0.1, 3e9
MODEL_ROWS = {  # method -> (runtime-model algorithm, schedule)
    "allreduce": ("allreduce", None),
    "flat exact (one-peer hypercube)": ("exact", "one_peer_hypercube"),
    "flat powergossip r=4": ("powergossip", "one_peer_hypercube"),
    "hierarchical exact": ("hierarchical_gossip", None),
    "hierarchical powergossip r=4": ("hierarchical_gossip", None),
}


def validate(rows: list[dict]) -> list[dict]:
    """Predicted (experiments.runtime_model) vs measured seconds per step; writes hierarchical_model.md.

    Message bytes come from the measured byte counts (exact, not timed): flat PowerGossip sends its per-step
    bytes to its one peer; hierarchical PowerGossip's node sends PER_NODE x (its bytes minus the two intra-node
    phases, 2 (L-1)/L M) across nodes.
    """
    cases = []
    for row in rows:
        algorithm, schedule = MODEL_ROWS[row["method"]]
        model, sent = row["model_bytes"], row["bytes_sent_per_rank_per_step"]
        message = None
        if algorithm == "powergossip":
            message = sent
        elif "powergossip" in row["method"]:
            message = PER_NODE * (sent - 2 * (PER_NODE - 1) / PER_NODE * model)
        cases.append({
            "label": row["method"], "algorithm": algorithm, "schedule": schedule, "message_bytes": message,
            "measured_ms": 1e3 * row["seconds_per_step"], "n": NODES * PER_NODE, "compute_ms": 1e-3,
            "model_bytes": model, "latency_ms": LOOPBACK_LATENCY_MS,
            "bandwidth_Bps": parse_rate(row["rate"], unit="byte/s"), "local_size": PER_NODE,
            "intra_latency_ms": LOOPBACK_LATENCY_MS, "intra_bandwidth_Bps": LOOPBACK_BPS,
            "allreduce_algorithm": "ring",
        })  # fmt: skip
    out = validation_table(cases)
    lines = [
        f"# Runtime model vs hierarchical.csv (2 nodes x 2 ranks, inter-node {rows[0]['rate']})",
        "",
        f"Model inputs: inter-node alpha {LOOPBACK_LATENCY_MS} ms, {rows[0]['rate']} per node uplink; intra-node "
        f"alpha {LOOPBACK_LATENCY_MS} ms, {LOOPBACK_BPS / 1e9:.0f} GB/s; compute 0; Gloo ring All-Reduce.",
        "",
        "| method | model algorithm | measured s/step | predicted s/step | relative error |",
        "|---|---|---|---|---|",
        *[f"| {r['label']} | {r['algorithm']} {r['schedule'] or ''} | {r['measured_ms'] / 1e3:.3f} | "
          f"{r['predicted_ms'] / 1e3:.3f} | {r['relative_error']:+.0%} |" for r in out],
    ]  # fmt: skip
    (RESULTS / "hierarchical_model.md").write_text("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    main()
