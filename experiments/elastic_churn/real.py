"""Training through churn with real processes: 8 Gloo workers of the main job, 2 SIGKILLed at step 150, 1 back at 300.

Every run is ``gossip-train --nproc 8`` (the main job's model, AdamW, lr 3e-3, batch 16 x 64 bytes per worker,
warm-up and cosine over 450 steps), validation every 25 steps on the main job's 8 fixed batches:

* ``elastic``: ``--elastic --algorithm exact --kill 2@150 --kill 5@150 --restart 2@300``: workers 2 and 5 SIGKILL
  themselves at the top of step 150, the 6 survivors re-form (one_peer_hypercube falls back to random_matchings),
  the launcher restarts worker 2, which joins from a neighbour when the group reaches step 300;
* ``gossip``: ``--elastic --algorithm exact``, nobody killed (the same code path, uninterrupted);
* ``ddp``: ``--algorithm ddp`` (torch DistributedDataParallel), uninterrupted;
* ``elastic-mt-sign`` and ``gossip-mt-sign``: ``elastic`` and ``gossip`` with sign momentum tracking
  (``--gradient-tracking sign --optimizer momentum-tracking-adamw --second-moment-every 0``: without the mean
  gradient's sample, which ``--elastic`` refused until it learnt to skip an interrupted one), whose trackers restart
  at each change; ``elastic-mt-sign-v64`` and ``gossip-mt-sign-v64`` the same with the sample every 64 steps (the
  main job's momentum tracking);
* ``ddp_restarted``: DERIVED from ``ddp``, not run: the main job cannot resume DDP from a checkpoint, so what
  ``torchrun --max-restarts`` gives with a checkpoint every 100 steps and a failure at step 150 is the ``ddp`` curve
  with steps 100-150 executed twice (the run is deterministic given its seed: their evaluations repeat) and
  everything after 50 executed steps later. The restart's own time is measured separately: the wall time of each
  ``ddp`` job minus its training time (process start, imports, group formation, data and model set-up, first
  validation, teardown), on the same machine.

The elastic runs write each member's parameters at every evaluation (``--save-replicas``); this module evaluates
the average over the members of that step offline (the averaged model, as the main job's validation loss does for
``ddp``), and the mean of the members' own validation losses, then deletes the files.

Writes ``results/curves_real.csv``, ``results/runs_real.json`` (wall and training times, membership events) and
``results/churn_real.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from experiments.elastic_churn.study import EVAL_EVERY, LEAVE, REJOIN, STEPS, WORKERS, restarted
from experiments.shared import pyplot, read_csv, save_figure, write_csv
from gossip.app.corpus import load_corpus, validation_batches
from gossip.app.gpt import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = {
    "elastic": ["--elastic", "--algorithm", "exact", "--save-replicas", "--kill", f"2@{LEAVE}", "--kill",
                f"5@{LEAVE}", "--restart", f"2@{REJOIN}"],
    "gossip": ["--elastic", "--algorithm", "exact", "--save-replicas"],
    "ddp": ["--algorithm", "ddp"],
}  # fmt: skip
SIGN_MOMENTUM_TRACKING = ["--gradient-tracking", "sign", "--optimizer", "momentum-tracking-adamw",
                          "--second-moment-every", "0"]  # fmt: skip
KINDS |= {f"{kind}-mt-sign": KINDS[kind] + SIGN_MOMENTUM_TRACKING for kind in ("elastic", "gossip")}
# the main job's momentum tracking: the mean gradient's second moment sampled every 64 steps, also under --elastic
KINDS |= {f"{kind}-mt-sign-v64": KINDS[kind] + SIGN_MOMENTUM_TRACKING[:-1] + ["64"] for kind in ("elastic", "gossip")}
ORDER = ("gossip", "elastic", "gossip-mt-sign", "elastic-mt-sign", "gossip-mt-sign-v64", "elastic-mt-sign-v64", "ddp",
         "ddp_restarted")  # fmt: skip


def command(kind: str, seed: int, out: Path) -> list[str]:
    """The ``gossip-train`` command line of one run."""
    return [sys.executable, "-m", "gossip", "--nproc", str(WORKERS), "--steps", str(STEPS), "--eval-every",
            str(EVAL_EVERY), "--seed", str(seed), "--out", str(out), *KINDS[kind]]  # fmt: skip


@torch.no_grad()
def evaluate_replicas(run_dir: Path) -> list[dict]:
    """Per evaluated step: the averaged model's validation loss over that step's members, and their mean own loss."""
    config = json.loads((run_dir / "config.json").read_text())
    corpus = load_corpus(config["data"], block_size=config["model"]["block_size"])
    held_out = validation_batches(corpus.validation, config["batch_size"], config["model"]["block_size"],
                                  config["eval_batches"])  # fmt: skip
    module = GPT(GPTConfig(**config["model"])).eval()

    def loss(state: dict) -> float:
        module.load_state_dict(state)
        return statistics.mean(module(x, y)[1].item() for x, y in held_out)

    by_step: dict[int, list[dict]] = {}
    for path in sorted((run_dir / "replicas").glob("*.pt")):
        saved = torch.load(path, weights_only=True)
        by_step.setdefault(saved["step"], []).append(saved)
    rows = []
    for step, saved in sorted(by_step.items()):
        states = [s["state"] for s in saved]
        mean = {
            key: sum(s[key].double() for s in states).div(len(states)).to(states[0][key].dtype) for key in states[0]
        }
        uids = " ".join(str(uid) for uid in sorted(s["uid"] for s in saved))
        rows.append({"step": step, "val_loss": loss(mean), "replica_val_loss": statistics.mean(map(loss, states)),
                     "members": len(saved), "uids": uids})  # fmt: skip
    return rows


def ddp_rows(run_dir: Path) -> list[dict]:
    """The DDP run's validation losses (metrics_rank0.jsonl: the row of step t holds the loss after t + 1 steps)."""
    rows = []
    for line in (run_dir / "metrics_rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val_loss" in record:
            value = record["val_loss"]
            rows.append({"step": record["step"] + 1, "val_loss": value, "replica_val_loss": value, "members": WORKERS,
                         "uids": ""})  # fmt: skip
    return rows


def run(kind: str, seed: int, workdir: Path) -> tuple[list[dict], dict]:
    """One run: its evaluations and its timings / membership events."""
    out = workdir / f"{kind}_s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        code = subprocess.run(command(kind, seed, out), stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{kind} seed {seed}: gossip-train exited {code}; see {out}.log")
    result = json.loads((out / "result.json").read_text())
    rows = evaluate_replicas(out) if kind != "ddp" else ddp_rows(out)
    shutil.rmtree(out / "replicas", ignore_errors=True)
    info = {"kind": kind, "seed": seed, "wall_seconds": wall, "train_seconds": result.get("train_seconds"),
            "final_val_loss_online": result.get("final_val_loss"),
            "membership": result.get("membership", [])}  # fmt: skip
    return [{"kind": kind, "seed": seed, **row} for row in rows], info


def restart_cost(repeats: int, workdir: Path) -> list[float]:
    """Wall seconds of a whole one-step DDP job of 8 workers: what a restart costs besides the lost steps, at most.

    It starts the launcher, the rendezvous, 8 interpreters with torch, the corpus, the model and the first
    validation, takes one step and writes its outputs; a restart from a checkpoint would also read the checkpoint
    (the parameters and AdamW's moments) and skip the sample and plots.
    """
    seconds = []
    for repeat in range(repeats):
        out = workdir / f"restart_cost_{repeat}"
        shutil.rmtree(out, ignore_errors=True)
        argv = [sys.executable, "-m", "gossip", "--nproc", str(WORKERS), "--algorithm", "ddp", "--steps", "1",
                "--out", str(out)]  # fmt: skip
        started = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        seconds.append(time.perf_counter() - started)
        print(f"one-step DDP job: {seconds[-1]:.1f} s", flush=True)
    return seconds


def plot(rows: list[dict]) -> Path:
    """``results/churn_real.png``: mean and range over the seeds of each run's validation loss."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind in ORDER:
        mine = [r for r in rows if r["kind"] == kind]
        steps = sorted({r["step"] for r in mine})
        values = [[r["val_loss"] for r in mine if r["step"] == s] for s in steps]
        (line,) = ax.plot(steps, [statistics.mean(v) for v in values], label=kind)
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2, color=line.get_color())
    ax.set_xlim(left=50)
    ax.set_ylim(top=min(ax.get_ylim()[1], 2.7))
    for step, text in ((LEAVE, "2 killed"), (REJOIN, "1 restarted")):
        ax.axvline(step, color="grey", linestyle=":")
        ax.text(step, ax.get_ylim()[0], text + " ", va="bottom", ha="right", rotation=90, fontsize=8)
    ax.set(xlabel="steps executed", ylabel="validation loss (averaged model)",
           title=f"{WORKERS} Gloo workers, kill at {LEAVE}, restart at {REJOIN}: mean, range over seeds")  # fmt: skip
    ax.legend()
    return save_figure(fig, RESULTS / "churn_real.png")


def main(argv: list[str] | None = None) -> int:
    """Run the study (or redraw it) and print the validation losses at fixed steps.

    Args:
        argv: the options (see ``--help``).

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--kinds", default="gossip,elastic,ddp")
    parser.add_argument("--workdir", type=Path, default=Path("runs/elastic_churn_real"))
    parser.add_argument("--redo", action="store_true", help="run again what results/curves_real.csv holds")
    parser.add_argument("--plot-only", action="store_true", help="redraw from results/curves_real.csv")
    parser.add_argument("--restart-cost", type=int, default=0, metavar="N",
                        help="only time N one-step DDP jobs (into results/runs_real.json)")  # fmt: skip
    args = parser.parse_args(argv)
    path, info_path = RESULTS / "curves_real.csv", RESULTS / "runs_real.json"
    rows = [r for r in read_csv(path) if r["kind"] != "ddp_restarted"] if path.exists() else []
    infos = json.loads(info_path.read_text()) if info_path.exists() else []
    if args.restart_cost:
        infos = [i for i in infos if i["kind"] != "restart_cost"]
        infos.append(
            {"kind": "restart_cost", "seed": None, "wall_seconds": restart_cost(args.restart_cost, args.workdir)}
        )
        info_path.write_text(json.dumps(infos, indent=1) + "\n")
        return 0
    if not args.plot_only:
        for seed in range(args.seeds):
            for kind in args.kinds.split(","):
                if not args.redo and any((r["kind"], r["seed"]) == (kind, seed) for r in rows):
                    continue  # measured already
                new, info = run(kind, seed, args.workdir)
                rows = [r for r in rows if (r["kind"], r["seed"]) != (kind, seed)] + new
                infos = [i for i in infos if (i["kind"], i["seed"]) != (kind, seed)] + [info]
                write_csv(path, rows)
                info_path.write_text(json.dumps(infos, indent=1) + "\n")
                print(f"seed {seed} {kind}: val loss at {STEPS} {new[-1]['val_loss']:.4f}, "
                      f"wall {info['wall_seconds']:.0f} s", flush=True)  # fmt: skip
    for seed in sorted({r["seed"] for r in rows if r["kind"] == "ddp"}):
        rows += restarted([r for r in rows if r["kind"] == "ddp" and r["seed"] == seed], "ddp_restarted")
    write_csv(path, rows)
    plot(rows)
    for kind in ORDER:
        for step in (LEAVE, LEAVE + 25, REJOIN, REJOIN + 25, STEPS):
            values = [r["val_loss"] for r in rows if r["kind"] == kind and r["step"] == step]
            if values:
                print(f"{kind} step {step}: {statistics.mean(values):.4f} (range {min(values):.4f}-{max(values):.4f}, "
                      f"{len(values)} seeds)")  # fmt: skip
    return 0
