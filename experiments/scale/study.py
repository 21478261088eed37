"""The scale sweeps: gossip against DDP at n = 16 ... 1024 replicas, on the replica-axis engine.

Three sweeps (:func:`sweep`), each arm paired with DDP on the same seed (the same initial model and the same tokens:
worker i draws rank i's batches of ``ShardedBatches``):

* ``strong``: a fixed global batch of ``GLOBAL_BATCH`` sequences, n in (16, 64, 256, 1024), b = B / n;
* ``weak``: a fixed ``WEAK_BATCH`` sequences per worker, n in (16, 64, 256);
* ``topology``: the default pipeline at ``WEAK_BATCH`` per worker on the one-peer hypercube, random matchings and
  the ring at n = 64 and 256, and at n = 24 and 96 (not powers of two) on the one-peer Base-2 graph
  (:func:`topologies.base_graph`, the default there) and random matchings (and the ring at 96), with DDP at each n.

Arms: ``ddp`` (the gradients all-reduced, AdamW), ``pipeline`` (:class:`gossip.Pipeline`'s defaults: PowerGossip
rank 4 x 2 in float16, sign momentum trackers, the mean gradient's second moment every 64 steps gossiped along the
schedule) and ``gossip`` (the same PowerGossip with AdamW, no trackers). Every ``record_every`` steps a run appends
to ``steps.csv`` the training loss (mean over workers and over the block of steps), the averaged model's and the
mean local validation loss (up to 8 workers evenly spaced) on held-out batches, the consensus distance Xi and the
bytes each worker has sent; at the end one line to ``summary.csv``. A run already in ``summary.csv`` is skipped, so
an interrupted sweep resumes where it stopped. Runs go seed by seed (every configuration of seed 0, then of seed 1,
...), so that a sweep cut short leaves whole pairs; ``--budget S`` starts a run only while it is predicted
(:func:`predicted_seconds`) to end within S seconds of the start, for a machine lent for a fixed time. A run
appends each record to ``steps.csv`` as it is made, so a run cut short (a lent machine taken back, a timeout)
leaves its curve up to its last record; it is not in ``summary.csv``, so the next sweep runs it again, first
removing those rows.
``--time`` instead times a few steps of each arm per n.

Every run warms the learning rate up as ``gossip-train`` does (:func:`gossip.app.train.default_warmup_steps`:
``steps // 10``, at most 100) unless ``--warmup`` names another length, which the run's name then carries
(``n16-b4-pipeline-warmup30``) and ``summary.csv``'s ``warmup`` column records, as it carries ``--steps`` other than
:data:`STEPS` (``n16-b4-pipeline-s500``); :mod:`experiments.scale.report` pairs each run with the DDP run of the
same length and warm-up.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import gossip
from experiments.scale.config import EngineConfig
from experiments.scale.engine import Engine
from experiments.shared import append_rows
from gossip.app.corpus import load_corpus, validation_batches
from gossip.app.train import default_warmup_steps

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = 1000
GLOBAL_BATCH = 1024
WEAK_BATCH = 4
STRONG_WORKERS = (16, 64, 256, 1024)
WEAK_WORKERS = (16, 64, 256)
ARMS = {
    "ddp": {"params": "ddp", "trackers": "", "optimizer": "adamw"},
    "pipeline": {},  # EngineConfig's defaults are the default pipeline's
    "gossip": {"trackers": "", "optimizer": "adamw"},
}
EVAL_BATCHES, EVAL_BATCH = 8, 16


def _arm(arm: str, prefix: str = "", schedule: str = "", **fields: object) -> EngineConfig:
    """A run named by what it is (n, b, arm; the schedule, the steps and the warm-up when not the defaults), so that
    sweeps share their runs and runs of other lengths or warm-ups never take their place."""
    config = EngineConfig(**ARMS[arm], **fields)
    if schedule == gossip.default_schedule(config.workers) or arm == "ddp":
        schedule = ""
    if config.warmup == default_warmup_steps(config.steps):
        config = config.replace(warmup=None)
    name = f"{prefix}n{config.workers}-b{config.batch}-{arm}" + (f"-{schedule}" if schedule else "")
    name += "" if config.steps == STEPS else f"-s{config.steps}"
    name += "" if config.warmup is None else f"-warmup{config.warmup}"
    return config.replace(name=name, schedule=schedule)


def sweep(name: str, steps: int = STEPS, warmup: int | None = None) -> list[EngineConfig]:
    """The configurations of a sweep, smallest n first.

    Args:
        name: ``"strong"``, ``"weak"``, ``"topology"`` or ``"smoke"`` (two workers' worth of everything, tiny).
        steps: every run's steps.
        warmup: every run's warm-up steps (None: the library's for ``steps``,
            :func:`gossip.app.train.default_warmup_steps`; the smoke sweep warms up over 2).

    Returns:
        The configurations (one per arm, n and schedule; the seeds are the caller's), named
            ``n{n}-b{b}-{arm}[-{schedule}][-s{steps}][-warmup{w}]`` (the schedule when it is not the default for
            n, the steps when they are not :data:`STEPS`, the warm-up when it is not the library's): a run two sweeps
            share has one name.

    Raises:
        ValueError: an unknown sweep.
    """
    runs: list[EngineConfig] = []
    if name == "strong":
        for n in STRONG_WORKERS:
            runs += [_arm(a, workers=n, batch=GLOBAL_BATCH // n, steps=steps, warmup=warmup) for a in ARMS]
    elif name == "weak":
        for n in WEAK_WORKERS:
            runs += [_arm(a, workers=n, batch=WEAK_BATCH, steps=steps, warmup=warmup) for a in ARMS]
    elif name == "topology":
        for n, schedules in ((24, ("base_graph", "random_matchings")),
                             (64, ("one_peer_hypercube", "random_matchings", "ring")),
                             (96, ("base_graph", "random_matchings", "ring")),
                             (256, ("one_peer_hypercube", "random_matchings", "ring"))):  # fmt: skip
            fields = {"workers": n, "batch": WEAK_BATCH, "steps": steps, "warmup": warmup}
            runs.append(_arm("ddp", **fields))
            runs += [_arm("pipeline", schedule=s, **fields) for s in schedules]
    elif name == "smoke":
        tiny = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16, "steps": steps, "warmup": 2}
        runs = [_arm(a, "smoke-", workers=n, batch=2, **tiny) for n in (8, 12) for a in ARMS]
        runs.append(_arm("pipeline", "smoke-", "ring", workers=8, batch=2, **tiny))
    else:
        raise ValueError(f"unknown sweep {name!r}; choose strong, weak, topology or smoke")
    return runs


def _data(config: EngineConfig, device: str) -> tuple:
    """The corpus (its training bytes feed the workers) and the held-out batches every record evaluates."""
    corpus = load_corpus(None, block_size=config.block_size)
    held_out = [(x.to(device), y.to(device)) for x, y in
                validation_batches(corpus.validation, EVAL_BATCH, config.block_size, EVAL_BATCHES)]  # fmt: skip
    return corpus, held_out


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_steps(engine: Engine, first: int, count: int, device: str) -> tuple[float, float]:
    """Wall and process CPU seconds per step of ``engine``'s steps ``first`` ... ``first + count - 1``."""
    _synchronize(device)
    started, cpu = time.perf_counter(), time.process_time()
    for step in range(first, first + count):
        engine.step(step)
    _synchronize(device)
    return (time.perf_counter() - started) / count, (time.process_time() - cpu) / count


def predicted_seconds(config: EngineConfig, device: str, grad_mode: str, record_every: int, probe: int = 2) -> float:
    """How long :func:`run` would take: an engine is built and steps once, then ``probe`` steps and one evaluation
    are timed; the prediction is the build and first step, plus ``steps`` times a probed step, plus one evaluation
    per record.

    Args:
        config: the configuration.
        device: where the engine runs.
        grad_mode: how the per-worker gradients are computed.
        record_every: steps between two records (each evaluates).
        probe: steps timed.

    Returns:
        Seconds.
    """
    corpus, held_out = _data(config, device)
    started = time.perf_counter()
    engine = Engine(config, corpus.train, device, grad_mode)
    engine.step(0)
    _synchronize(device)
    built = time.perf_counter() - started
    per_step, _ = _timed_steps(engine, 1, probe, device)
    started = time.perf_counter()
    engine.evaluate(held_out)
    per_record = time.perf_counter() - started
    return built + config.steps * per_step + math.ceil(config.steps / record_every) * per_record


def run(config: EngineConfig, seed: int, device: str, grad_mode: str, record_every: int, out: Path) -> dict:
    """Train one configuration with one seed, appending each record to ``out``/steps.csv as it is made (after
    removing the rows an earlier, unfinished run of the same configuration and seed left there); return its summary.

    A progress bar on stderr shows the steps done and the last record's training and validation loss.

    Args:
        config: the configuration (its ``seed`` is replaced).
        seed: the seed.
        device: where the engine runs.
        grad_mode: how the per-worker gradients are computed.
        record_every: steps between two records.
        out: the results folder.

    Returns:
        The summary row (also appended to ``out``/summary.csv).

    Raises:
        FloatingPointError: the training loss is not finite.
    """
    config = config.replace(seed=seed)
    forget_unfinished(out / "steps.csv", config.name, seed)
    corpus, held_out = _data(config, device)
    engine = Engine(config, corpus.train, device, grad_mode)
    started, losses = time.perf_counter(), []
    progress = tqdm(total=config.steps, desc=f"{config.name} seed {seed}", unit="step", mininterval=30.0)
    for step in range(config.steps):
        losses.append(engine.step(step).mean())
        progress.update()
        if (step + 1) % record_every == 0 or step + 1 == config.steps:
            block = float(torch.stack(losses).mean())
            if not math.isfinite(block):
                raise FloatingPointError(f"{config.name} seed {seed}: training loss {block} at step {step}")
            last = {"config": config.name, "seed": seed, "workers": config.workers, "batch": config.batch,
                    "warmup": config.warmup_steps(), "schedule": engine.schedule.name, "step": step + 1,
                    "train_loss": block,
                    **engine.evaluate(held_out), "bytes_per_worker": engine.bytes_per_worker(),
                    "seconds": time.perf_counter() - started}  # fmt: skip
            append_rows(out / "steps.csv", [last])
            progress.set_postfix(train=f"{block:.3f}", val=f"{last['avg_val_loss']:.3f}", refresh=False)
            losses = []
    progress.close()
    summary = {key: last[key] for key in ("config", "seed", "workers", "batch", "warmup", "schedule", "step")}
    summary |= {
        "final_avg_val_loss": last["avg_val_loss"],
        "final_local_val_loss": last["local_val_loss"],
        "final_consensus": last["consensus"],
        "bytes_per_worker_per_step": last["bytes_per_worker"] / config.steps,
        "seconds_per_step": last["seconds"] / config.steps,
        "device": device,
        "grad_mode": grad_mode,
    }
    append_rows(out / "summary.csv", [summary])
    return summary


def forget_unfinished(path: Path, name: str, seed: int) -> None:
    """Remove from ``steps.csv`` the rows of configuration ``name`` and ``seed`` (those of a run that did not
    finish, about to run again), leaving every other row as it was written; the file is replaced atomically.

    Args:
        path: ``steps.csv`` (nothing happens when it does not exist).
        name: the configuration's name.
        seed: the seed.
    """
    if not path.exists():
        return
    with path.open(newline="") as handle:
        lines = list(csv.reader(handle))
    if not lines:
        return
    header, rows = lines[0], lines[1:]
    config, seed_column = header.index("config"), header.index("seed")
    kept = [row for row in rows if not (row[config] == name and int(row[seed_column]) == seed)]
    if len(kept) == len(rows):
        return
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", newline="") as handle:
        csv.writer(handle).writerows([header, *kept])
    os.replace(partial, path)


def done_runs(path: Path, step: int | None = None) -> set[tuple[str, int]]:
    """The (config, seed) pairs already in a summary CSV.

    Args:
        path: ``summary.csv``.
        step: only the runs that ended at this step (None: every run).

    Returns:
        The pairs (empty when the file does not exist).
    """
    if not path.exists():
        return set()
    with path.open() as handle:
        rows = csv.DictReader(handle)
        return {(row["config"], int(row["seed"])) for row in rows if step is None or int(row["step"]) == step}


def time_steps(workers: list[int], batch: int, steps: int, device: str, grad_mode: str, arms: list[str]) -> list[dict]:
    """Wall and CPU seconds per step of each arm at each n (after one warm-up step), ``batch`` sequences a worker.

    Args:
        workers: the n to time.
        batch: sequences per worker.
        steps: timed steps per arm (after the warm-up step).
        device: where the engine runs.
        grad_mode: how the per-worker gradients are computed.
        arms: the arms to time (keys of :data:`ARMS`).

    Returns:
        One row per (n, arm).
    """
    corpus = load_corpus(None, block_size=EngineConfig().block_size)
    rows = []
    for n in workers:
        for arm in arms:
            engine = Engine(_arm(arm, "time-", workers=n, batch=batch), corpus.train, device, grad_mode)
            engine.step(0)
            seconds, cpu = _timed_steps(engine, 1, steps, device)
            rows.append({"workers": n, "batch": batch, "arm": arm, "seconds_per_step": seconds,
                         "cpu_seconds_per_step": cpu, "device": device, "grad_mode": grad_mode})  # fmt: skip
            print(f"n={n} b={batch} {arm}: {seconds:.3f} s/step ({cpu:.3f} s of CPU)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m experiments.scale --help``).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", nargs="+", default=["strong", "weak", "topology"],
                        choices=["strong", "weak", "topology", "smoke"])  # fmt: skip
    parser.add_argument("--only", nargs="*", help="run only these configuration names, in this order")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps (default: the library's, steps // 10 capped at 100)")  # fmt: skip
    parser.add_argument("--max-workers", type=int, default=1024, help="skip configurations with more workers")
    parser.add_argument("--record-every", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grad-mode", default="batched", choices=["loop", "vmap", "batched"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--list", action="store_true", help="print the runs and exit")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help="run the runs in order while each is predicted to end within these seconds from the start "
                             "(predicted_seconds: a few steps timed first), skip the others")  # fmt: skip
    parser.add_argument("--time", type=int, nargs="*", metavar="N", help="time the arms' steps at these n instead")
    parser.add_argument("--time-batch", type=int, default=WEAK_BATCH)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.time is not None:
        workers = args.time or list(WEAK_WORKERS)
        rows = time_steps(workers, args.time_batch, max(1, args.steps), args.device, args.grad_mode, args.arms)
        append_rows(args.out / "step_times.csv", rows)
        return 0
    configs = [c for name in args.sweep for c in sweep(name, args.steps, args.warmup) if c.workers <= args.max_workers]
    configs = list({c.name: c for c in configs}.values())  # a run two sweeps share runs once
    configs = [c for c in configs if any(f"-{arm}" in c.name for arm in args.arms)]
    if args.only:
        named = {c.name: c for c in configs}
        unknown = [name for name in args.only if name not in named]
        if unknown:
            parser.error(
                f"--only: {', '.join(unknown)}: not a run of --sweep {' '.join(args.sweep)} with --arms "
                f"{' '.join(args.arms)} and --max-workers {args.max_workers} (--list without --only prints them)"
            )
        configs = [named[name] for name in args.only]
    done = done_runs(args.out / "summary.csv")
    jobs = [(c, s) for s in args.seeds for c in configs if (c.name, s) not in done]  # a seed's pairs together
    deadline = None if args.budget is None else time.monotonic() + args.budget
    predictions: dict[str, float] = {}
    for config, seed in jobs:
        if args.list:
            print(f"{config.name} seed {seed}: n={config.workers} b={config.batch} {config.build_schedule().name}")
            continue
        if deadline is not None:
            if config.name not in predictions:
                predictions[config.name] = predicted_seconds(config, args.device, args.grad_mode, args.record_every)
            left = deadline - time.monotonic()
            if predictions[config.name] > left:
                print(f"{config.name} seed {seed}: skipped, predicted {predictions[config.name]:.0f} s with "
                      f"{left:.0f} s of the budget left", flush=True)  # fmt: skip
                continue
        summary = run(config, seed, args.device, args.grad_mode, args.record_every, args.out)
        print(summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
