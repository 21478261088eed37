"""Training through churn on the simulator: 2 of 8 workers leave at step 150, one rejoins at step 300.

Three runs per seed, the small GPT of :mod:`experiments.shared` (AccumAdamW, lr 3e-3, warm-up 20 steps, cosine),
one_peer_hypercube (its fallbacks over 6 and 7 workers):

* ``elastic``: exact gossip through :func:`gossip.wrapper.elastic_sim.simulate_elastic` -- workers 2 and 5 leave
  before step 150 (the survivors re-form, fresh per-edge state), worker 2 rejoins before step 300 with its donor's
  parameters and optimizer state;
* ``gossip``: the same without churn;
* ``allreduce``: a global parameter average every step (the synchronous baseline), without churn. What torchrun
  ``--max-restarts`` gives it when a worker dies at step 150 with a checkpoint every 100 steps is derived from this
  run: the 50 steps since the checkpoint are trained again (``allreduce_restarted``: the same curve, shifted right by
  50 executed steps after step 150; the restart's own time is not counted).

Writes ``results/curves.csv`` (every evaluation of every run) and ``results/churn.png``; prints the final validation
losses, mean and spread over the seeds.
"""

from __future__ import annotations

import argparse
import statistics
import threading
from pathlib import Path

import torch

import gossip
import optim
from experiments.shared import BATCH, MODEL, pyplot, read_csv, save_figure, write_csv
from gossip.app.corpus import ShardedBatches, load_corpus, validation_batches
from gossip.app.gpt import GPT
from gossip.app.train import TrainConfig, learning_rate, validation_loss
from gossip.wrapper.elastic_sim import Change, Member, simulate_elastic

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS, STEPS, EVAL_EVERY, LR = 8, 450, 25, 3e-3
LEAVE, REJOIN, CHECKPOINT_EVERY = 150, 300, 100
CHANGES = {"elastic": [Change(LEAVE, 2), Change(LEAVE, 5), Change(REJOIN, 2, join=True)], "gossip": [], "allreduce": []}


def run(kind: str, seed: int) -> list[dict]:
    """One run; returns its evaluations (step, val loss, members)."""
    corpus = load_corpus(None, block_size=MODEL.block_size)
    held_out = validation_batches(corpus.validation, BATCH, MODEL.block_size, 8)
    config = TrainConfig(lr=LR, steps=STEPS, warmup_steps=20)
    torch.set_num_threads(1)
    lock = threading.Lock()
    rows: list[dict] = []

    def build(comm, schedule, algorithm, uid):
        with lock:
            torch.manual_seed(seed)
            module = GPT(MODEL)
        model = gossip.DecentralizedDataParallel(module, comm, schedule, algorithm, seed=seed, consensus_every=0)
        optimizer = optim.AccumAdamW(optim.param_groups(model.module, 0.1), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                                     accum_iter=1)  # fmt: skip
        batches = ShardedBatches(corpus.train, uid, WORKERS, BATCH, MODEL.block_size, seed, "iid")
        return Member(uid, model, optimizer, {"batches": batches})

    def train_step(member: Member, step: int) -> None:
        model, optimizer = member.model, member.optimizer
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        x, y = member.extra["batches"].batch(step)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % EVAL_EVERY == 0:
            value = validation_loss(model, held_out, model.comm)
            if model.comm.rank == 0:
                rows.append({"kind": kind, "seed": seed, "step": step + 1, "val_loss": value,
                             "members": model.comm.size})  # fmt: skip

    algorithm = gossip.AllReduce if kind == "allreduce" else gossip.ExactGossip
    simulate_elastic(WORKERS, STEPS, CHANGES[kind], build=build, train_step=train_step,
                     schedule="one_peer_hypercube", algorithm=algorithm, timeout=600.0)  # fmt: skip
    return rows


def restarted(rows: list[dict], kind: str = "allreduce_restarted") -> list[dict]:
    """An uninterrupted curve as a restart from the last checkpoint would give it, on the axis of executed steps.

    Steps up to the failure run once; then the steps since the checkpoint run again (their evaluations repeat, the
    run being deterministic) and the rest follows, ``lost`` executed steps later. The rows get ``kind``.
    """
    checkpoint = (LEAVE // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    lost = LEAVE - checkpoint
    out = [{**row, "kind": kind} for row in rows if row["step"] <= LEAVE]
    out += [{**row, "kind": kind, "step": row["step"] + lost} for row in rows
            if row["step"] > checkpoint and row["step"] + lost <= STEPS]  # fmt: skip
    return out


def plot(rows: list[dict]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind in ("gossip", "elastic", "allreduce", "allreduce_restarted"):
        mine = [r for r in rows if r["kind"] == kind]
        steps = sorted({r["step"] for r in mine})
        means = [statistics.mean(r["val_loss"] for r in mine if r["step"] == s) for s in steps]
        spread = [max(r["val_loss"] for r in mine if r["step"] == s) - min(r["val_loss"] for r in mine if r["step"]
                                                                           == s) for s in steps]  # fmt: skip
        (line,) = ax.plot(steps, means, label=kind)
        ax.fill_between(
            steps,
            [m - d / 2 for m, d in zip(means, spread, strict=True)],
            [m + d / 2 for m, d in zip(means, spread, strict=True)],
            alpha=0.2,
            color=line.get_color(),
        )
    for step, text in ((LEAVE, "2 leave"), (REJOIN, "1 rejoins")):
        ax.axvline(step, color="grey", linestyle=":")
        ax.text(step, ax.get_ylim()[1], text, va="top", ha="right", rotation=90, fontsize=8)
    ax.set(xlabel="steps executed", ylabel="validation loss (averaged model)",
           title=f"{WORKERS} workers, churn at {LEAVE} and {REJOIN}: mean and range over seeds")  # fmt: skip
    ax.legend()
    return save_figure(fig, RESULTS / "churn.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true", help="redraw from results/curves.csv")
    args = parser.parse_args()
    path = RESULTS / "curves.csv"
    if args.plot_only:
        rows = [row for row in read_csv(path) if row["kind"] != "allreduce_restarted"]
        rows += restarted([row for row in rows if row["kind"] == "allreduce"])
        write_csv(path, rows)
    else:
        rows = []
        for seed in range(args.seeds):
            for kind in CHANGES:
                new = run(kind, seed)
                rows += new + (restarted(new) if kind == "allreduce" else [])
                write_csv(path, rows)
                print(f"seed {seed} {kind}: final val loss {new[-1]['val_loss']:.4f}", flush=True)
    plot(rows)
    for kind in ("gossip", "elastic", "allreduce", "allreduce_restarted"):
        finals = [r["val_loss"] for r in rows if r["kind"] == kind and r["step"] == STEPS]
        if finals:
            spread = max(finals) - min(finals)
            print(f"{kind}: final val loss {statistics.mean(finals):.4f} (range {spread:.4f}, {len(finals)} seeds)")
    return 0
