r"""One worker of the gossip-train task trained with decent-dp's DecentralizedDataParallel (the reference library of
Wang et al., arXiv 2410.11998; docs/design.md B.1-B.6), for side-by-side comparisons with ``python -m gossip``.

decent-dp is an experiment-only dependency, pinned here and not in setup.cfg::

    PIP_CONSTRAINT=.ci/constraints.txt pip install decent-dp==0.2.3   # keeps the pinned CPU torch

Same task as ``gossip-train``: the same GPT config (GPTConfig defaults), corpus (stdlib, ``load_corpus``), batches
(``ShardedBatches``: a pure function of (seed, rank, step)), learning-rate schedule (``gossip.app.train.learning_rate``:
linear warmup, cosine to lr / 10), seed, AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only and
accum_iter = max(1, n // 4). The optimizer is decent-dp's own ``AccumAdamW`` (moments advance once every accum_iter
steps); its ``optim_fn_accum_adamw`` helper is not used because it puts weight decay on biases instead of matrices.

decent-dp's update (one step stale, B.1): the backward hook of step t waits for the mixing launched at step t-1,
mixes, then applies the optimizer and launches the next mixing:

.. math::  x_i^{t+1} = \sum_j W_{ij}(t)\, x_j^{t-1/2} - \eta_t\, d_i^t,

every mixing being an async all_reduce over a small process group (one edge of its topology). The first optimizer
step happens in the forward of step 1 (decent-dp's lazy initialisation), as in the library.

Run it under a torchrun-style launcher (it needs RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*), e.g.::

    python -m experiments.netem run --hosts 8 --rate 100mbit -- \
        python -m experiments.time_to_loss.decentdp_runner --out runs/x

Rank 0 writes ``<out>/metrics.csv`` (step, loss, mean_loss, val_loss, lr, bytes_sent, cumulative_bytes_sent,
elapsed_seconds, step_seconds) and ``result.json`` like ``gossip-train``. ``bytes_sent`` per step is the Gloo ring
all-reduce volume 2 (g - 1) / g * M of a g-rank edge over the M-byte bucket (M for a pair), not a counter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from gossip.app.corpus import ShardedBatches, load_corpus, validation_batches
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.run_dir import FINAL_WINDOW, write_metrics_csv
from gossip.app.train import TrainConfig, learning_rate, resolve

DECENT_DP_VERSION = "0.2.3"
TOPOLOGIES = ("one-peer-exp", "alternating-exp-ring", "ring", "complete")


class DecentDPUnavailable(ImportError):
    """decent-dp is not installed (or another version is)."""


def _import_decent_dp():
    try:
        from importlib.metadata import version

        from decent_dp.ddp import DecentralizedDataParallel
        from decent_dp.optim import AccumAdamW
    except ImportError as err:
        raise DecentDPUnavailable(
            f"experiments.time_to_loss.decentdp_runner needs decent-dp=={DECENT_DP_VERSION}: "
            f"PIP_CONSTRAINT=.ci/constraints.txt pip install decent-dp=={DECENT_DP_VERSION} ({err})"
        ) from err
    if version("decent-dp") != DECENT_DP_VERSION:
        print(f"warning: decent-dp {version('decent-dp')} installed; written for {DECENT_DP_VERSION}", file=sys.stderr)
    return DecentralizedDataParallel, AccumAdamW


def make_optim_fn(config: TrainConfig, accum_adamw: type) -> partial:
    """decent-dp's ``optim_fn``: one AccumAdamW per bucket with gossip-train's hyper-parameters and groups."""
    return partial(_bucket_optimizer, config=config, accum_adamw=accum_adamw)


def _bucket_optimizer(named: list[tuple[str, torch.Tensor]], config: TrainConfig, accum_adamw: type):
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return accum_adamw(
        [g for g in groups if g["params"]], lr=config.lr, betas=(0.9, 0.95), eps=1e-8, accum_iter=config.accum_iter
    )


def make_scheduler_fn(config: TrainConfig) -> partial:
    """decent-dp's ``lr_scheduler_fn``: LambdaLR following ``gossip.app.train.learning_rate`` (stepped per update)."""
    return partial(_bucket_scheduler, config=config)


def _bucket_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate(config, step) / config.lr)


def edge_bytes(model_bytes: int, group_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``model_bytes`` over ``group_size`` ranks: 2 (g-1)/g M."""
    return 2 * (group_size - 1) / group_size * model_bytes if group_size > 1 else 0.0


@torch.no_grad()
def averaged_validation_loss(model, batches: list, rank: int, world_size: int) -> float:
    """Mean loss of the globally averaged model (decent-dp's global_avg, then reverted); a collective."""
    model.global_avg(will_revert=True)
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for x, y in batches[rank::world_size]:
        totals[0] += model(x, y)[1].item()
        totals[1] += 1
    dist.all_reduce(totals)
    model.train()
    model.revert_global_avg()
    return float(totals[0] / totals[1])


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="python -m experiments.time_to_loss.decentdp_runner", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--topology", choices=TOPOLOGIES, default="one-peer-exp", help="decent-dp topology")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--accum-iter", type=int, default=None, help="default: max(1, workers // 4)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--out", required=True, help="run directory (must not hold a run)")
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("steps", "batch_size", "eval_every", "lr"):
        if not getattr(args, name) > 0:
            parser.error(f"argument --{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if args.accum_iter is not None and args.accum_iter < 1:
        parser.error(f"argument --accum-iter: must be >= 1, got {args.accum_iter}")
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR") if k not in os.environ
    ]
    if missing:
        parser.error(f"needs torchrun's environment; missing {missing} (launch with torchrun or experiments.netem)")


def train_config(args: argparse.Namespace, world_size: int) -> TrainConfig:
    """The run's settings as ``gossip-train`` would resolve them, recorded in ``config.json``: the optimizer is
    decent-dp's AccumAdamW whatever ``gossip-train``'s default is (``algorithm``/``schedule`` are placeholders that
    ``resolve`` accepts; ``config.json`` replaces them with decent-dp and its topology)."""
    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        optimizer="accum-adamw",
        accum_iter=args.accum_iter,
        seed=args.seed,
        eval_every=args.eval_every,
        out=args.out,
        algorithm="exact",
        schedule="ring",
    )
    return resolve(config, world_size)[0]


def run(args: argparse.Namespace) -> dict | None:
    """Train one worker; return rank 0's result dict (None elsewhere)."""
    ddp_class, accum_adamw = _import_decent_dp()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    config = train_config(args, world_size)
    out = Path(args.out)
    if rank == 0:
        if (out / "config.json").exists():
            raise ValueError(f"--out: {str(out)!r} already holds a run; choose another directory")
        out.mkdir(parents=True, exist_ok=True)
        described = {**config.to_json(), "algorithm": f"decent-dp {DECENT_DP_VERSION}", "schedule": args.topology}
        (out / "config.json").write_text(json.dumps(described, indent=2) + "\n")
    corpus = load_corpus(None, block_size=config.model["block_size"])
    torch.manual_seed(config.seed)
    module = GPT(GPTConfig(**config.model))
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    model = ddp_class(module, make_optim_fn(config, accum_adamw), make_scheduler_fn(config), topology=args.topology)
    batches = ShardedBatches(
        corpus.train, rank, world_size, config.batch_size, config.model["block_size"], config.seed, config.split
    )
    held_out = validation_batches(corpus.validation, config.batch_size, config.model["block_size"], config.eval_batches)
    rows, losses = [], []
    dist.barrier()
    started = previous = time.perf_counter()
    for step in range(config.steps):
        x, y = batches.batch(step)
        _, loss = model(x, y)
        loss.backward()  # decent-dp: wait for last mixing, mix, optimizer step, launch next mixing
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"rank {rank}: training loss is {losses[-1]} at step {step}; lower --lr")
        now = time.perf_counter()
        group = len(model._topo.get_edge(step + 1).ranks)
        row = {
            "step": step,
            "loss": losses[-1],
            "lr": learning_rate(config, step),
            "bytes_sent": edge_bytes(model_bytes, group) if step >= 1 else 0.0,
            "elapsed_seconds": now - started,
            "step_seconds": now - previous,
        }
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:  # timed like gossip-train: counted
            row["val_loss"] = averaged_validation_loss(model, held_out, rank, world_size)
        previous = now
        rows.append(row)
    train_seconds = rows[-1]["elapsed_seconds"]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, losses)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return _write_outputs(out, rows, gathered, config, model_bytes, train_seconds)


def _write_outputs(out: Path, rows: list, losses_by_rank: list, config: TrainConfig, model_bytes: int, seconds: float):
    mean_losses = [sum(values) / len(values) for values in zip(*losses_by_rank, strict=True)]
    cumulative = 0.0
    for row, mean_loss in zip(rows, mean_losses, strict=True):
        cumulative += row["bytes_sent"]
        row["mean_loss"], row["cumulative_bytes_sent"] = mean_loss, cumulative
    write_metrics_csv(out / "metrics.csv", rows)
    tail = mean_losses[-FINAL_WINDOW:]
    result = {
        "initial_train_loss": mean_losses[0],
        "final_train_loss": sum(tail) / len(tail),
        "final_val_loss": rows[-1]["val_loss"],
        "bytes_sent_per_worker_per_step": cumulative / len(rows),
        "mean_step_seconds": sum(r["step_seconds"] for r in rows) / len(rows),
        "train_seconds": seconds,
        "model_bytes": model_bytes,
        "decent_dp_version": DECENT_DP_VERSION,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"decent-dp: final train loss {result['final_train_loss']:.3f}, val {result['final_val_loss']:.3f}, "
        f"{result['mean_step_seconds'] * 1e3:.1f} ms/step, run dir {out}",
        flush=True,
    )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    run(args)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as gossip-train: skip torch's static destructors, which can crash a Gloo process at exit
