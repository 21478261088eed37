r"""Learning per step: why PowerGossip + a decentralized Adam learns less per step than All-Reduce, and what fixes it.

Every configuration trains ``gossip-train``'s task (the byte-level GPT of :mod:`gossip.app.gpt` at its default size,
the stdlib corpus, iid :class:`gossip.app.corpus.ShardedBatches`, lr 3e-3 with linear warm-up then a cosine to lr / 10,
betas (0.9, 0.95), weight decay 0.1 on matrices) on ``n`` virtual ranks of the in-process simulator
(:func:`gossip.simulate`): deterministic, no network, so only learning per step is compared. Per configuration and
seed it records

* every ``RECORD_EVERY`` steps: the training loss (mean over ranks and over the block of steps), the exact
  consensus distance :math:`\Xi = \sqrt{\frac1n \sum_i \lVert x_i - \bar x\rVert^2}` (:func:`gossip.wrapper.consensus.
  exact_consensus_sq`) and the bytes each worker has sent so far;
* at the end: the validation loss of the averaged model :math:`\bar x` on the held-out batches;
* with ``spectrum``: at ``SPECTRUM_STEPS``, for every compressed weight matrix, the singular values of the replica
  difference :math:`D = X_0 - X_1` and of :math:`X_i - \bar X`: the energy share a rank-r projection captures,
  :math:`\sum_{k<r}\sigma_k^2 / \sum_k \sigma_k^2`, and the stable rank :math:`\lVert D\rVert_F^2/\lVert D\rVert_2^2`.

Mixing rules (the order of one step is :class:`gossip.DecentralizedDataParallel`'s, Decent-DP's schema):

* ``ddp``: All-Reduce of the gradients (mean over ranks, summed in rank order) before one AdamW step on every rank,
  so the replicas stay identical; :math:`2\frac{n-1}{n} M` bytes per worker per step (ring all-reduce, M = model
  bytes).
* ``atc``: each rank's own AdamW step, then an exact average of the parameters over all ranks (All-Reduce,
  adapt-then-combine): replicas identical at every forward, as under DDP, but each rank's optimizer sees only its
  own gradient; the diagnostic that separates per-rank Adam from the overlap order (where the gradient is taken
  at the rank's own, not yet mixed, parameters).
* ``none``: no communication at all (each rank trains alone from the same initial model): the drift that mixing
  must remove.
* ``exact``, ``powergossip``: the library's :class:`gossip.ExactGossip` and :class:`gossip.PowerGossip` on the
  one-peer hypercube.
* ``diloco``: the low-communication baseline beside ``ddp``, the library's :class:`gossip.DiLoCo` (Douillard et al.,
  "DiLoCo: Distributed Low-Communication Training of Language Models", 2023, Alg. 1): ``local_steps`` H local steps
  of the configured optimizer, then an all-reduce of the pseudo-gradient and an outer Nesterov SGD step
  (``outer_lr``, ``outer_momentum``) that every replica takes; :math:`2\frac{n-1}{n} M / H` bytes per worker per
  step. (The recorded consensus distance is taken after each step's update, so after a synchronisation it is one
  local update's spread, not zero.)
* ``gradient_tracking``: the wrapper's gradient tracking (:mod:`gossip.wrapper.tracking`; NEXT, Di Lorenzo &
  Scutari 2016; DIGing, Nedić, Olshevsky & Shi 2017): each rank's optimizer steps on a tracker
  :math:`y_i \leftarrow \sum_j W_{ij}(y_j + g_j^t - g_j^{t-1})` of the mean gradient, exchanged over the same
  schedule as the parameters whatever their algorithm: exactly (``True``, one more model's bytes per worker per
  step) or by this configuration's PowerGossip (``"powergossip"``).
* ``average_every = K``: :class:`gossip.PeriodicAverage` -- every K-th step an exact global average of the
  parameters replaces the inner algorithm's mixing (gossip with periodic global averaging, Chen, Yuan, Zhang,
  Pan, Xu, Yin, "Accelerating Gossip SGD with Periodic Global Averaging", ICML 2021, Alg. 1); on average
  :math:`2\frac{n-1}{n} M / K` bytes per worker per step on top of the inner algorithm's. (The n = 8 sweep in
  the study's README.md ran an equivalent harness-level wrapper that passed the training step to the inner
  algorithm unchanged; :class:`gossip.PeriodicAverage` numbers the inner steps without the averaging steps.)
* ``choco``: a compact harness-level CHOCO-Gossip (Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization
  and Gossip Algorithms with Compressed Communication", ICML 2019, Alg. 1) with top-k compression and the public
  copies :math:`\hat x` as error feedback, on the static ring (CHOCO needs a fixed neighbourhood), for comparison
  only: :class:`ChocoTopK`.

Optimizers: ``adamw`` (:class:`optim.AccumAdamW` with ``accum_iter=1``, i.e. AdamW), ``accum-adamw`` (AccumAdamW
with ``accum_iter``), ``debiased-adamw`` (:class:`NoiseDebiasedAdamW`, harness-level: AdamW dividing by a local
estimate of the second moment of the *mean* gradient over the n workers), ``smoothed-v-adamw``
(:class:`SmoothedSecondMomentAdamW`), ``shared-v-adamw`` (:class:`SharedSecondMomentAdamW`: the second moment of the
mean gradient, sampled by an all-reduce every ``v_every`` steps, the same on every rank), ``tracked-m-adamw``
(:class:`TrackedMomentumAdamW`: with ``gradient_tracking`` on, momentum tracking -- the trackers carry each rank's
first moment -- and the second moment named by ``v_source``) and ``sgd`` (Nesterov momentum 0.9).

``python -m experiments.learning_per_step --suite study --jobs 16`` runs every configuration of the study (each
(configuration, seed) in its own process) and appends to ``<out>/steps.csv``, ``summary.csv`` and ``spectrum.csv``
as runs finish, so an interrupted sweep keeps what it finished. ``--suite smoke`` is a few steps of each kind;
``--device cuda`` puts every run's virtual ranks on one GPU, which they share.
:mod:`experiments.learning_per_step.report` turns the CSVs into the tables and plots of the study's README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import gossip
import optim
import topologies
from experiments.learning_per_step.mixing import ChocoTopK, NoMixing
from experiments.learning_per_step.optimizers import (
    NoiseDebiasedAdamW,
    SharedSecondMomentAdamW,
    SmoothedSecondMomentAdamW,
    TrackedMomentumAdamW,
)
from experiments.learning_per_step.spectrum import spectrum_rows
from experiments.shared import append_rows
from gossip.algorithms.base import Algorithm
from gossip.app.corpus import ShardedBatches, load_corpus, validation_batches
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import TrainConfig, learning_rate
from gossip.wrapper.consensus import exact_consensus_sq

RESULTS = Path(__file__).resolve().parent / "results" / "sweep_16core"
RECORD_EVERY = 10
SPECTRUM_STEPS = (10, 100, 300, 1000)
EVAL_BATCHES = 8
FINAL_TAIL_STEPS = 50  # final_train_loss: the mean over ranks and over the last this many steps


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One configuration of the study; ``name`` identifies it in the CSVs."""

    name: str
    algorithm: str = "powergossip"  # ddp | atc | none | exact | powergossip | choco | diloco
    rank: int = 1
    iterations: int = 1
    gamma: float = 1.0
    message_dtype: str = ""  # powergossip: "float16" or "bfloat16" messages ("": the parameters' float32)
    average_every: int = 0  # exact global average every K steps, replacing the inner mixing (0: never)
    topk: float = 0.01  # choco: share of coordinates sent per step
    local_steps: int = 20  # diloco: local steps between two synchronisations (H)
    outer_lr: float = 0.7  # diloco: the outer Nesterov SGD's learning rate
    outer_momentum: float = 0.9  # diloco: and its momentum
    between: str = ""  # diloco: "powergossip" mixes the replicas every step between synchronisations (a hybrid)
    gradient_tracking: bool | str = False  # the wrapper's gradient tracking: the optimizer steps on y_i, not g_i;
    # True: exact trackers, "powergossip": trackers mixed by this configuration's PowerGossip (rank, iterations, dtype),
    # "choco-sign": by CHOCO-Gossip with scaled-sign messages (ChocoSign: tracker_gamma, tracker_chunk, tracker_levels)
    tracker_gamma: float = 1.0  # choco-sign trackers: the consensus step size
    tracker_chunk: int = 128  # choco-sign trackers: values per scale
    tracker_levels: int = 1  # choco-sign trackers: magnitudes per chunk (2: one more bit a value)
    tracking_overlap: bool = False  # the trackers' exchange during forward and backward (combine-then-adapt)
    delayed_last_iteration: bool = False  # PowerGossip's last power iteration applied at the next step
    optimizer: str = "adamw"  # adamw | accum-adamw | debiased-adamw | smoothed-v-adamw | shared-v-adamw |
    # tracked-m-adamw | sgd
    beta1: float = 0.9
    beta2: float = 0.95
    accum_iter: int = 1
    v_beta: float = -1.0  # smoothed-v-adamw: EMA rate of the gradients whose square v tracks (-1: (n-1)/(n+1))
    average_moments: str = ""  # "m", "v" or "mv": the AdamW moments averaged over all ranks after every step
    v_every: int = 1  # shared-v-adamw: steps between two samples of the mean gradient (an all-reduce each)
    v_source: str = "local"  # tracked-m-adamw: the second moment, "local", "debiased" or "shared" (every v_every)
    mean_gradient: str = "allreduce"  # tracked-m-adamw, "shared": the wrapper's mean_gradient ("gossip": along the
    # schedule's exact hops, no collective; "allreduce": at once, what every run before issue 59 used)
    lr: float = 3e-3
    warmup: int = 30
    workers: int = 8
    batch: int = 8
    steps: int = 1000
    spectrum: bool = False

    def describe(self) -> str:
        fields = dataclasses.asdict(self)
        defaults = dataclasses.asdict(RunConfig(name=self.name))
        return ", ".join(f"{k}={v}" for k, v in fields.items() if k != "name" and v != defaults[k])


# -- one run --------------------------------------------------------------------------------------------------
def make_algorithm(config: RunConfig) -> Algorithm:
    if config.algorithm == "diloco":
        if config.average_every:
            raise ValueError(f"{config.name}: diloco synchronises every local_steps steps; average_every must be 0")
        if config.between == "powergossip":  # the PowerGossip of this configuration every step, DiLoCo every H
            between = make_algorithm(dataclasses.replace(config, algorithm="powergossip", between=""))
            return gossip.OuterOptimizer(gossip.AllReduce(), config.local_steps, config.outer_lr,
                                         config.outer_momentum, between=between)  # fmt: skip
        if config.between:
            raise ValueError(f"{config.name}: between must be '' or 'powergossip', got {config.between!r}")
        return gossip.DiLoCo(config.local_steps, outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)
    if config.algorithm == "none":
        inner: Algorithm = NoMixing()
    elif config.algorithm == "exact":
        inner = gossip.ExactGossip(gamma=config.gamma)
    elif config.algorithm == "powergossip":
        message_dtype = getattr(torch, config.message_dtype) if config.message_dtype else None
        inner = gossip.PowerGossip(
            rank=config.rank,
            num_iterations=config.iterations,
            gamma=config.gamma,
            message_dtype=message_dtype,
            delayed_last_iteration=config.delayed_last_iteration,
        )
    elif config.algorithm == "choco":
        inner = ChocoTopK(config.topk, config.gamma)
    else:
        raise ValueError(f"unknown algorithm {config.algorithm!r} (ddp and atc run without a mixing algorithm)")
    return gossip.PeriodicAverage(inner, config.average_every) if config.average_every else inner


def tracking(config: RunConfig) -> bool | Algorithm:
    """The wrapper's ``gradient_tracking`` for ``config``: False, True (exact trackers) or the trackers' algorithm."""
    if config.gradient_tracking == "powergossip":
        return make_algorithm(dataclasses.replace(config, algorithm="powergossip", average_every=0))
    if config.gradient_tracking == "choco-sign":
        return gossip.ChocoSign(config.tracker_gamma, config.tracker_chunk, config.tracker_levels)
    if not isinstance(config.gradient_tracking, bool):
        raise ValueError(f"{config.name}: gradient_tracking must be a bool, 'powergossip' or 'choco-sign'")
    return config.gradient_tracking


def make_schedule(config: RunConfig) -> topologies.Schedule:
    if config.algorithm == "choco":
        return topologies.ring(config.workers)
    return topologies.one_peer_hypercube(config.workers)


def make_optimizer(config: RunConfig, module: torch.nn.Module) -> torch.optim.Optimizer:
    groups = optim.param_groups(module, 0.1)
    if config.optimizer == "sgd":
        return optim.SGD(groups, lr=config.lr, momentum=0.9, nesterov=True)
    adam = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": 1e-8}
    if config.optimizer == "debiased-adamw":
        return NoiseDebiasedAdamW(groups, **adam, workers=config.workers)
    if config.optimizer == "shared-v-adamw":
        return SharedSecondMomentAdamW(groups, **adam, every=config.v_every, floor=config.workers)
    if config.optimizer == "tracked-m-adamw":
        return TrackedMomentumAdamW(groups, **adam, v_source=config.v_source, workers=config.workers,
                                    every=config.v_every)  # fmt: skip
    if config.optimizer == "smoothed-v-adamw":
        v_beta = config.v_beta if config.v_beta >= 0 else (config.workers - 1) / (config.workers + 1)
        return SmoothedSecondMomentAdamW(groups, **adam, v_beta=v_beta)
    accum = config.accum_iter if config.optimizer == "accum-adamw" else 1
    return optim.AccumAdamW(groups, **adam, accum_iter=accum)


def _average_in_place(tensors: list[torch.Tensor], comm: gossip.Communicator) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, "avg")
    torch._foreach_copy_(
        tensors, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]
    )


def _average_gradients(module: torch.nn.Module, comm: gossip.Communicator) -> None:
    _average_in_place([p.grad for p in module.parameters() if p.grad is not None], comm)


@torch.no_grad()
def _average_parameters(module: torch.nn.Module, comm: gossip.Communicator) -> None:
    _average_in_place([p.data for p in module.parameters()], comm)


@torch.no_grad()
def _averaged_validation(module: torch.nn.Module, comm: gossip.Communicator, batches: list) -> float:
    """Validation loss of the averaged parameters; each rank evaluates its share. A collective."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double()
    comm.all_reduce(flat, "avg")
    saved = [p.detach().clone() for p in module.parameters()]
    offset = 0
    for p in module.parameters():
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    totals = torch.zeros(2, dtype=torch.float64, device=flat.device)
    module.eval()
    for x, y in batches[comm.rank :: comm.size]:
        totals[0] += module(x, y)[1].double()
        totals[1] += 1
    module.train()
    for p, s in zip(module.parameters(), saved, strict=True):
        p.copy_(s)
    comm.all_reduce(totals, "sum")
    return float(totals[0] / totals[1])


MOMENT_KEYS = {"m": "beta1_exp_avg", "v": "beta2_exp_avg_sq"}


def _average_moments(optimizer: torch.optim.Optimizer, which: str, comm: gossip.Communicator) -> None:
    """Replace AccumAdamW's moments named in ``which`` ("m", "v") by their mean over all ranks (one all-reduce):
    a diagnostic of how much of the gap to DDP the workers' local optimizer state makes, not a method."""
    tensors = [
        state[MOMENT_KEYS[key]] for key in which for group in optimizer.param_groups for p in group["params"]
        if (state := optimizer.state.get(p))
    ]  # fmt: skip
    _average_in_place(tensors, comm)


def train_run(config: RunConfig, seed: int, device: str = "cpu") -> dict[str, list[dict]]:
    """Train ``config`` with ``seed`` on ``device`` (every virtual rank's model and batches there, e.g.
    ``"cuda"``: the ranks share one GPU); return its ``steps``, ``summary`` and ``spectrum`` rows."""
    model_config = GPTConfig()
    corpus = load_corpus(None, block_size=model_config.block_size)
    held_out = [
        (x.to(device), y.to(device))
        for x, y in validation_batches(corpus.validation, config.batch, model_config.block_size, EVAL_BATCHES)
    ]
    schedule_config = TrainConfig(lr=config.lr, steps=config.steps, warmup_steps=config.warmup)
    init_lock = threading.Lock()
    model_bytes = 0
    started = time.perf_counter()

    def worker(comm: gossip.Communicator) -> dict[str, list[dict]]:
        nonlocal model_bytes
        with init_lock:  # the virtual ranks share torch's global generator: seed and draw atomically
            torch.manual_seed(seed)
            module = GPT(model_config).to(device)
        model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        all_reduce_run = config.algorithm in ("ddp", "atc")  # identical replicas by an all-reduce, no wrapper
        algorithm = None if all_reduce_run else make_algorithm(config)
        if all_reduce_run:
            wrapped: torch.nn.Module = module
            parameters = list(module.parameters())
        else:
            wrapped = gossip.DecentralizedDataParallel(
                module,
                comm,
                make_schedule(config),
                algorithm,
                seed=seed,
                gradient_tracking=tracking(config),
                tracking_overlap=config.tracking_overlap,
                mean_gradient=config.mean_gradient,
            )
            parameters = [b.buffer for b in wrapped.buckets]
        optimizer = make_optimizer(config, module)
        batches = ShardedBatches(corpus.train, comm.rank, comm.size, config.batch, model_config.block_size, seed, "iid")
        ring_bytes = 2 * (comm.size - 1) / comm.size * model_bytes
        steps, spectrum, losses = [], [], []
        sampled_bytes = 0.0  # the shared second moment's gradient all-reduces
        for step in range(config.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(schedule_config, step)
            x, y = (t.to(device) for t in batches.batch(step))
            _, loss = wrapped(x, y)
            loss.backward()
            if config.algorithm == "ddp":
                _average_gradients(module, comm)
            if isinstance(optimizer, SharedSecondMomentAdamW) and step % config.v_every == 0:
                grads = {p: p.grad.detach().clone() for p in module.parameters() if p.grad is not None}
                _average_in_place(list(grads.values()), comm)
                optimizer.sample(grads)
                sampled_bytes += ring_bytes
            # a momentum-tracking optimizer: the wrapper samples the mean gradient and prepares the first moment
            optimizer.step()
            if config.algorithm == "atc":
                _average_parameters(module, comm)
            if config.average_moments:
                _average_moments(optimizer, config.average_moments, comm)
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                where = f"{config.name} seed {seed}: rank {comm.rank}, step {step}"
                raise FloatingPointError(f"{where}: training loss {losses[-1]}; lower lr")
            if (step + 1) % RECORD_EVERY == 0 or step + 1 == config.steps:
                block = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64, device=device)
                comm.all_reduce(block, "avg")
                sent = ring_bytes * (step + 1) if all_reduce_run else float(algorithm.traffic.total_sent)
                sent += sampled_bytes
                total_sent = torch.tensor([sent], dtype=torch.float64, device=device)
                comm.all_reduce(total_sent, "avg")
                consensus = math.sqrt(exact_consensus_sq(parameters, comm))
                steps.append(
                    {"config": config.name, "seed": seed, "step": step + 1, "train_loss": float(block),
                     "consensus": consensus, "bytes_per_worker": float(total_sent)}
                )  # fmt: skip
                losses = []
            if config.spectrum and step + 1 in SPECTRUM_STEPS:
                named = {n: p.detach().cpu().clone() for n, p in module.named_parameters() if p.ndim == 2}
                replicas = comm.all_gather_object(named)
                if comm.rank == 0:
                    spectrum += spectrum_rows(config.name, seed, step + 1, replicas, algorithm)
        val = _averaged_validation(module, comm, held_out)
        if not all_reduce_run:
            wrapped.close()
        return {"steps": steps, "spectrum": spectrum, "val": val}

    results = gossip.simulate(config.workers, worker, timeout=1800.0, device=device)
    rows = results[0]["steps"]
    tail = [r["train_loss"] for r in rows if r["step"] > config.steps - FINAL_TAIL_STEPS]
    summary = {
        "config": config.name,
        "seed": seed,
        "steps": config.steps,
        "workers": config.workers,
        "final_train_loss": sum(tail) / len(tail),
        "val_loss_averaged": results[0]["val"],
        "final_consensus": rows[-1]["consensus"],
        "bytes_per_worker_per_step": rows[-1]["bytes_per_worker"] / config.steps,
        "ddp_bytes_per_worker_per_step": 2 * (config.workers - 1) / config.workers * model_bytes,
        "seconds": time.perf_counter() - started,
        "settings": config.describe(),
    }
    return {"steps": rows, "summary": [summary], "spectrum": results[0]["spectrum"]}


# -- the suites ----------------------------------------------------------------------------------------------
def suite(name: str) -> list[RunConfig]:
    """The configurations of a suite, most important first (a sweep cut short keeps the head of the list)."""
    c = RunConfig
    if name == "smoke":
        common = {"steps": 20, "warmup": 5, "workers": 4}
        return [
            c("ddp", algorithm="ddp", **common),
            c("diloco-h5", algorithm="diloco", local_steps=5, **common),
            c("pg1", spectrum=True, **common),
            c("pg1-avg10", average_every=10, **common),
            c("choco", algorithm="choco", gamma=0.5, **common),
            c("none-sgd", algorithm="none", optimizer="sgd", lr=0.1, spectrum=True, **common),
            c("accum", optimizer="accum-adamw", accum_iter=2, beta2=0.99, **common),
        ]
    if name != "study":
        raise ValueError(f"unknown suite {name!r}; choose smoke or study")
    d: dict[str, Any] = {}
    short = {"steps": 300}
    main_job = {"workers": 4, "batch": 16, "steps": 300}  # gossip-train's n = 4 and batch 16; 300 of its 500 steps
    many = {"workers": 16, "batch": 1}
    accum4 = {"optimizer": "accum-adamw", "accum_iter": 4, "beta2": 0.99}  # AccumAdamW as its paper sets it at n = 16
    pg = {"rank": 4, "iterations": 2, "message_dtype": "float16"}  # the main job's PowerGossip
    plain_average = {"algorithm": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0}  # the outer step is an average
    hybrid = {"local_steps": 10, "between": "powergossip", **plain_average, **pg}  # the defaults + an average every 10
    hybrid_paper = dict(hybrid, outer_lr=0.7, outer_momentum=0.9)  # ... + the paper's outer step instead
    s4000 = {"steps": 4000, "warmup": 100}
    mt = {"optimizer": "tracked-m-adamw"}  # momentum tracking (with gradient_tracking on)
    exact_mt = {"algorithm": "exact", "gradient_tracking": True, **mt}

    def shared_v(every: int) -> dict[str, Any]:
        return {"v_source": "shared", "v_every": every}

    def n16_defaults_and_diloco(suffix: str, **length: int) -> list[RunConfig]:
        return [
            c(f"n16b1-pg4-it2-fp16{suffix}", **pg, **length, **many),
            c(f"n16b1-pg4-it2-fp16-gt{suffix}", gradient_tracking=True, **pg, **length, **many),
            c(f"n16b1-diloco-h10-olr1.0-m0{suffix}", local_steps=10, **plain_average, **length, **many),
        ]

    return [
        c("ddp", algorithm="ddp", **d),
        c("pg1", spectrum=True, **d),
        c("pg1-avg32", average_every=32, **d),
        c("exact", algorithm="exact", **d),
        c("pg4", rank=4, spectrum=True, **d),
        c("avg32-only", algorithm="none", average_every=32, **d),
        c("pg1-it4", iterations=4, **d),
        c("mj-pg1", spectrum=True, **main_job),
        c("mj-pg4", rank=4, spectrum=True, **main_job),
        c("mj-none", algorithm="none", **main_job),
        c("mj-exact", algorithm="exact", **main_job),
        c("mj-ddp", algorithm="ddp", **main_job),
        c("mj-pg4-g0.5", rank=4, gamma=0.5, **main_job),
        c("mj-exact-accum2", algorithm="exact", optimizer="accum-adamw", accum_iter=2, beta2=0.99, **main_job),
        c("mj-exact-lr6e-3", algorithm="exact", lr=6e-3, **main_job),
        c("mj-pg1-it4", iterations=4, spectrum=True, **main_job),
        c("mj-pg4-it2", rank=4, iterations=2, **main_job),
        c("none-adamw", algorithm="none", spectrum=True, **short),
        c("none-sgd", algorithm="none", optimizer="sgd", lr=0.1, spectrum=True, **short),
        c("pg1-sgd", optimizer="sgd", lr=0.1, spectrum=True, **short),
        c("pg1-g0.5", gamma=0.5, spectrum=True, **d),
        c("pg1-avg16", average_every=16, **d),
        c("choco-top1-g0.5", algorithm="choco", topk=0.01, gamma=0.5, **d),
        c("pg1-avg32-accum2", average_every=32, optimizer="accum-adamw", accum_iter=2, beta2=0.99, **d),
        c("ddp-accum2", algorithm="ddp", optimizer="accum-adamw", accum_iter=2, beta2=0.99, **d),
        c("pg1-avg32-wu100", average_every=32, warmup=100, **d),
        c("pg1-it4-avg64", iterations=4, average_every=64, **d),
        c("pg4-it2", rank=4, iterations=2, **d),
        c("pg4-it2-wu100", rank=4, iterations=2, warmup=100, **d),
        c("pg4-avg32", rank=4, average_every=32, **d),
        c("pg4-sgd", rank=4, optimizer="sgd", lr=0.1, spectrum=True, **short),
        c("pg1-avg64", average_every=64, **d),
        c("pg1-avg32-lr1.5e-3", average_every=32, lr=1.5e-3, **d),
        c("pg1-avg32-accum4", average_every=32, optimizer="accum-adamw", accum_iter=4, beta2=0.999, **d),
        # Where exact gossip's gap comes from: every replica replaced by the global mean after every step, each
        # rank keeping its own AdamW moments (consensus zero, local optimizer state), and a larger lr.
        c("avg1-only", algorithm="none", average_every=1, **d),
        c("exact-lr6e-3", algorithm="exact", lr=6e-3, **d),
        c("avg1-lr8.5e-3", algorithm="none", average_every=1, lr=8.5e-3, **d),
        # AccumAdamW where its paper expects it to pay: n = 8, accum n or n/2, beta2 as before or raised (its
        # moments advance A x less often)
        # how much of the gap the local optimizer state makes: parameters and moments averaged every step
        c("avg1-mv", algorithm="none", average_every=1, average_moments="mv", **d),
        c("avg1-m", algorithm="none", average_every=1, average_moments="m", **d),
        c("avg1-debiased", algorithm="none", average_every=1, optimizer="debiased-adamw", **d),
        c("exact-accum8", algorithm="exact", optimizer="accum-adamw", accum_iter=8, beta2=0.99, **d),
        # AdamW with the second moment of the mean gradient estimated locally (NoiseDebiasedAdamW)
        c("exact-debiased", algorithm="exact", optimizer="debiased-adamw", **d),
        c("exact-accum8-b0.95", algorithm="exact", optimizer="accum-adamw", accum_iter=8, **d),
        c("exact-accum4", algorithm="exact", optimizer="accum-adamw", accum_iter=4, beta2=0.99, **d),
        # Adapt-then-combine: the parameters averaged right AFTER every local AdamW step, so every rank computes
        # its gradient at the same point (as DDP does), vs avg1-*: averaged at the step, gradient at the local point
        c("atc-avg1", algorithm="atc", **d),
        c("atc-avg1-mv", algorithm="atc", average_moments="mv", **d),
        # the second moment of a short EMA of the local gradients, matched to the mean of n workers' noise
        c("avg1-smoothv", algorithm="none", average_every=1, optimizer="smoothed-v-adamw", **d),
        c("exact-smoothv", algorithm="exact", optimizer="smoothed-v-adamw", **d),
        # step budgets for the time to DDP's final loss: DDP 300 steps (time_to_loss's DDP run) against the default
        # PowerGossip with its own, shorter-than-1000 schedules; warm-up as gossip-train's (steps // 10, at most 100)
        c("ddp-s300", algorithm="ddp", steps=300, warmup=30),
        c("pg4-it2-s400", rank=4, iterations=2, steps=400, warmup=40),
        c("pg4-it2-s500", rank=4, iterations=2, steps=500, warmup=50),
        c("pg4-it2-s600", rank=4, iterations=2, steps=600, warmup=60),
        # the consensus target (3x exact gossip's) against the byte budget (1/20 of DDP's): the defaults with a
        # periodic exact average, every 64 steps (1/20 of DDP's bytes in all) or 32 (1/15)
        c("pg4-it2-avg64", rank=4, iterations=2, average_every=64, **d),
        c("pg4-it2-avg32", rank=4, iterations=2, average_every=32, **d),
        c("pg4-avg32-accum4", rank=4, average_every=32, optimizer="accum-adamw", accum_iter=4, beta2=0.99, **d),
        # consensus per byte from more power iterations: rank 4 x 3 (1.5x the defaults' bytes, 1/20 of DDP's) and
        # rank 2 x 4 (the defaults' bytes)
        c("pg4-it3", rank=4, iterations=3, **d),
        c("pg2-it4", rank=2, iterations=4, **d),
        # the products in float16 (half their bytes): the defaults at half the products' bytes, and twice / three
        # times the iterations for the defaults' bytes (1/34 of DDP's) and for 1/24 of DDP's
        c("pg4-it2-fp16", rank=4, iterations=2, message_dtype="float16", **d),
        c("pg4-it2-bf16", rank=4, iterations=2, message_dtype="bfloat16", **d),
        c("pg4-it4-fp16", rank=4, iterations=4, message_dtype="float16", **d),
        c("pg4-it6-fp16", rank=4, iterations=6, message_dtype="float16", **d),
        c("pg4-it7-fp16", rank=4, iterations=7, message_dtype="float16", **d),  # 1/21 of DDP's bytes
        # the second moment of the mean gradient, sampled every K steps by an all-reduce and shared by all ranks
        # (first moment local): K = 1 (an all-reduce of the gradients every step: a diagnostic) and 32 (with the
        # defaults' PowerGossip, 1/32 + 1/59 of DDP's bytes would fit within 1/20)
        c("exact-sharedv1", algorithm="exact", optimizer="shared-v-adamw", v_every=1, **d),
        c("exact-sharedv32", algorithm="exact", optimizer="shared-v-adamw", v_every=32, **d),
        c("mj-pg4-it2-fp16", rank=4, iterations=2, message_dtype="float16", **main_job),
        c("mj-pg4-it2-bf16", rank=4, iterations=2, message_dtype="bfloat16", **main_job),
        # a longer first-moment average for per-worker Adam (Decent-DP's tuned DAdam: beta1 0.974, a larger lr): the
        # noise of each rank's m shrinks with (1 - beta1) / (1 + beta1), so each replica drifts less per step and
        # can take a larger one; DDP with the same betas, so that the comparison stays fair
        c("exact-b0.97", algorithm="exact", beta1=0.97, **d),
        c("exact-b0.97-lr6e-3", algorithm="exact", beta1=0.97, lr=6e-3, **d),
        c("ddp-b0.97", algorithm="ddp", beta1=0.97, **d),
        c("exact-b0.97-0.99-lr6e-3", algorithm="exact", beta1=0.97, beta2=0.99, lr=6e-3, **d),
        # a longer second-moment average for per-worker Adam (beta1 as before): v of 8-sequence gradients is noisy
        # and correlated with the current gradient (a large gradient enlarges its own denominator), which a longer
        # average dilutes; DDP with the same betas
        c("exact-b2-0.99", algorithm="exact", beta2=0.99, **d),
        c("ddp-b2-0.99", algorithm="ddp", beta2=0.99, **d),
        c("exact-b2-0.999", algorithm="exact", beta2=0.999, **d),
        c("pg4-it2-fp16-b2-0.99", rank=4, iterations=2, message_dtype="float16", beta2=0.99, **d),
        c("mj-pg4-it2-fp16-b2-0.99", rank=4, iterations=2, message_dtype="float16", beta2=0.99, **main_job),
        c("mj-ddp-b2-0.99", algorithm="ddp", beta2=0.99, **main_job),
        # error feedback as the comparison point the issue asks for: CHOCO-Gossip with top-k (values and indices,
        # 8 bytes a coordinate) on the static ring, at about the defaults' bytes (top 1 % to 2 neighbours: 70 kB a
        # step, 1/44 of DDP's), and the consensus step gamma; and gamma for the defaults after the PowerGossip fix
        c("choco-top1-g0.1", algorithm="choco", topk=0.01, gamma=0.1, **d),
        c("pg4-it2-fp16-g0.5", rank=4, iterations=2, message_dtype="float16", gamma=0.5, **d),
        # AccumAdamW nearer its own regime: 16 workers with one sequence each (the global batch of one main-job
        # worker), accum n/4 and n/2 with beta2 raised, against AdamW on the same exact gossip and DDP
        c("n16b1-ddp", algorithm="ddp", **many),
        c("n16b1-exact", algorithm="exact", **many),
        c("n16b1-exact-accum4", algorithm="exact", **accum4, **many),
        c("n16b1-exact-accum8", algorithm="exact", **dict(accum4, accum_iter=8), **many),
        # and 4x longer (warm-up as gossip-train's: steps // 10, at most 100): does the deficit shrink with steps?
        c("n16b1-exact-s4000", algorithm="exact", **s4000, **many),
        c("n16b1-exact-accum4-s4000", algorithm="exact", **s4000, **accum4, **many),
        # and 10x longer, the length of the runs AccumAdam was made for: does the deficit close, or turn into a gain?
        c("n16b1-ddp-s10000", algorithm="ddp", steps=10000, warmup=100, **many),
        c("n16b1-exact-s10000", algorithm="exact", steps=10000, warmup=100, **many),
        c("n16b1-exact-accum4-s10000", algorithm="exact", steps=10000, warmup=100, **accum4, **many),
        # DiLoCo, the low-communication baseline beside DDP: AdamW inner steps, the paper's outer Nesterov SGD (lr 0.7,
        # momentum 0.9); H = 20 is 1/20 of DDP's bytes (the byte budget), H = 50 1/50; at the study's and at the main
        # job's scale
        c("diloco-h20", algorithm="diloco", local_steps=20, **d),
        c("diloco-h50", algorithm="diloco", local_steps=50, **d),
        c("mj-diloco-h20", algorithm="diloco", local_steps=20, **main_job),
        # Issue 27: the mean gradient without an all-reduce per step. Gradient tracking (the wrapper's exact
        # trackers, one more exchange of model size per step) on exact gossip and on the PowerGossip defaults, and
        # AccumAdamW stepping on the trackers; DiLoCo over H (paper's outer lr 0.7) and a small outer-lr grid
        c("exact-gt", algorithm="exact", gradient_tracking=True, **d),
        # issue 27 item 4: the defaults with the last power iteration applied a step later (its exchange overlaps
        # the next step's compute): what the delay costs per step
        c("pg4-it2-fp16-delayed", rank=4, iterations=2, message_dtype="float16", delayed_last_iteration=True, **d),
        c("pg4-it2-fp16-gt", rank=4, iterations=2, message_dtype="float16", gradient_tracking=True, **d),
        c("diloco-h10", algorithm="diloco", local_steps=10, **d),
        c("diloco-h200", algorithm="diloco", local_steps=200, **d),
        *(
            c(f"diloco-h{h}-olr{lr}", algorithm="diloco", local_steps=h, outer_lr=lr, **d)
            for h in (10, 50, 200)
            for lr in (0.5, 1.0)
        ),
        c(
            "exact-gt-accum4",
            algorithm="exact",
            gradient_tracking=True,
            optimizer="accum-adamw",
            accum_iter=4,
            beta2=0.99,
            **d,
        ),
        c("n16b1-exact-gt-s4000", algorithm="exact", gradient_tracking=True, **s4000, **many),
        c("n16b1-exact-gt", algorithm="exact", gradient_tracking=True, **many),
        # the outer step without momentum at lr 1 is a plain average of the replicas every H steps (local AdamW);
        # the hybrid gossips every step with the defaults' PowerGossip and takes DiLoCo's outer step every H
        c("diloco-h10-olr1.0-m0", algorithm="diloco", local_steps=10, outer_lr=1.0, outer_momentum=0.0, **d),
        c(
            "hybrid-pg4-it2-fp16-h10",
            algorithm="diloco",
            local_steps=10,
            between="powergossip",
            rank=4,
            iterations=2,
            message_dtype="float16",
            **d,
        ),
        c("n16b1-ddp-s4000", algorithm="ddp", **s4000, **many),
        # n = 16 x 1 at 4000 steps and at 1000 (beside n16b1-ddp and n16b1-exact): the defaults with and without
        # tracking, and the best DiLoCo of the n = 8 grid
        *n16_defaults_and_diloco("-s4000", **s4000),
        *n16_defaults_and_diloco(""),
        # at n = 16 x 1 compression costs more than at n = 8 x 8: do twice the power iterations (and bytes) close it?
        c("n16b1-pg4-it4-fp16", rank=4, iterations=4, message_dtype="float16", **many),
        c("n16b1-pg4-it4-fp16-s4000", rank=4, iterations=4, message_dtype="float16", **s4000, **many),
        # the rest of the families at n = 16 x 1, 1000 steps: the hybrid with a plain average (outer lr 1, no
        # momentum) every 10 steps, the plain average every 50, the paper's outer step, AccumAdamW on trackers
        c("n16b1-hybrid-pg4-it2-fp16-h10-olr1.0-m0", **hybrid, **many),
        c("n16b1-diloco-h50-olr1.0-m0", local_steps=50, **plain_average, **many),
        c("n16b1-exact-gt-accum4", algorithm="exact", gradient_tracking=True, **accum4, **many),
        c("n16b1-diloco-h10", algorithm="diloco", local_steps=10, **many),
        # n = 8 x 8 at 4000 steps (warm-up as gossip-train's): DDP, exact gossip, the defaults, the plain average
        c("ddp-s4000", algorithm="ddp", **s4000),
        c("exact-s4000", algorithm="exact", **s4000),
        c("pg4-it2-fp16-s4000", **s4000, **pg),
        c("diloco-h10-olr1.0-m0-s4000", local_steps=10, **s4000, **plain_average),
        # the rest of the grid: the hybrid with a plain average at n = 8 x 8 (1000 and 4000 steps) and at n = 16 x 1
        # (4000 steps), a plain average every 200 steps at n = 16 x 1, tracking and 4 power iterations at n = 8 x 8 and
        # 4000 steps
        c("hybrid-pg4-it2-fp16-h10-olr1.0-m0", **hybrid),
        c("hybrid-pg4-it2-fp16-h20-olr1.0-m0", **dict(hybrid, local_steps=20)),  # within 1/10 of DDP's bytes
        c("hybrid-pg4-it2-fp16-h10-olr1.0-m0-s4000", **hybrid, **s4000),
        c("n16b1-hybrid-pg4-it2-fp16-h10-olr1.0-m0-s4000", **hybrid, **s4000, **many),
        c("n16b1-diloco-h200-olr1.0-m0", local_steps=200, **plain_average, **many),
        c("exact-gt-s4000", algorithm="exact", gradient_tracking=True, **s4000),
        c("pg4-it2-fp16-gt-s4000", gradient_tracking=True, **pg, **s4000),
        c("pg4-it4-fp16-s4000", **dict(pg, iterations=4), **s4000),
        # does the paper's outer step (Nesterov momentum 0.9, lr 0.7) pay once the run is 4x longer? Beside the
        # plain average every 10 steps (diloco-h10-olr1.0-m0-s4000), the only difference the outer step
        c("diloco-h10-s4000", algorithm="diloco", local_steps=10, **s4000),
        # and the defaults' PowerGossip between the paper's outer steps
        c("hybrid-pg4-it2-fp16-h10-s4000", **hybrid_paper, **s4000),
        # the paper's outer step at n = 16 x 1 and 4000 steps, beside n16b1-diloco-h10-olr1.0-m0-s4000
        c("n16b1-diloco-h10-s4000", algorithm="diloco", local_steps=10, **s4000, **many),
        c("n16b1-hybrid-pg4-it2-fp16-h10-s4000", **hybrid_paper, **s4000, **many),
        # DiLoCo's H grid at 4000 steps: the paper's outer step every 50 and 200 steps, at both n
        c("diloco-h50-s4000", algorithm="diloco", local_steps=50, **s4000),
        c("n16b1-diloco-h50-s4000", algorithm="diloco", local_steps=50, **s4000, **many),
        c("diloco-h200-s4000", algorithm="diloco", local_steps=200, **s4000),
        c("n16b1-diloco-h200-s4000", algorithm="diloco", local_steps=200, **s4000, **many),
        # AccumAdamW on exact trackers at n = 8 x 8 and 4000 steps, beside exact-gt-s4000
        c("exact-gt-accum4-s4000", algorithm="exact", gradient_tracking=True, **accum4, **s4000),
        # AccumAdamW on exact trackers at 4000 steps, beside n16b1-exact-gt-s4000 and n16b1-exact-accum4-s4000
        c("n16b1-exact-gt-accum4-s4000", algorithm="exact", gradient_tracking=True, **accum4, **s4000, **many),
        # momentum tracking: the trackers carry each rank's first moment (a tenth of the gradient's noise per step)
        # instead of its gradient; the second moment local, locally debiased, or the mean gradient's (a diagnostic)
        c("exact-mt-sharedv1", **exact_mt, **shared_v(1), **d),
        c("exact-mt-sharedv32", **exact_mt, **shared_v(32), **d),
        c("exact-mt", **exact_mt, **d),
        c("exact-mt-debiased", **exact_mt, v_source="debiased", **d),
        # ... and within the byte budget: the defaults' PowerGossip for the parameters, exact or compressed trackers
        c("pg4-it2-fp16-mt-sharedv32", gradient_tracking=True, **mt, **shared_v(32), **pg, **d),
        c("pg4-it2-fp16-mtpg-sharedv32", gradient_tracking="powergossip", **mt, **shared_v(32), **pg, **d),
        c("n16b1-exact-mt-sharedv32-s4000", **exact_mt, **shared_v(32), **s4000, **many),
        # ... and within a tenth of DDP's bytes: the defaults' PowerGossip and sign trackers, as at n = 8 x 8
        c(
            "n16b1-pg4-it2-fp16-mtsign4-c256-sharedv64-s4000",
            gradient_tracking="choco-sign",
            tracker_levels=4,
            tracker_chunk=256,
            **mt,
            **shared_v(64),
            **pg,
            **s4000,
            **many,
        ),
        # issue 59: the same, with the mean gradient averaged by gossip along the hypercube (no collective), at both n
        c(
            "n16b1-pg4-it2-fp16-mtsign4-c256-gossipv64-s4000",
            gradient_tracking="choco-sign",
            tracker_levels=4,
            tracker_chunk=256,
            mean_gradient="gossip",
            **mt,
            **shared_v(64),
            **pg,
            **s4000,
            **many,
        ),
        c(
            "pg4-it2-fp16-mtsign4-c256-gossipv64",
            gradient_tracking="choco-sign",
            tracker_levels=4,
            tracker_chunk=256,
            mean_gradient="gossip",
            **mt,
            **shared_v(64),
            **pg,
            **d,
        ),
        # a slower first moment changes less per step, so compressed trackers might keep up: beta1 0.95 and 0.99,
        # beside DDP with beta1 0.99
        c("ddp-b0.99", algorithm="ddp", beta1=0.99, **d),
        # the defaults' PowerGossip and exact momentum trackers whose exchange overlaps forward and backward
        c(
            "pg4-it2-fp16-mt-sharedv32-overlap",
            gradient_tracking=True,
            tracking_overlap=True,
            **mt,
            **shared_v(32),
            **pg,
            **d,
        ),
        # within the byte budget with full-rank compression: the trackers by CHOCO-Gossip with scaled-sign messages
        # (1 bit a value and a scale per chunk), whose error feedback keeps what a message leaves out
        *(
            c(
                f"pg4-it2-fp16-mtsign{suffix}-sharedv{v_every}",
                gradient_tracking="choco-sign",
                **mt,
                **shared_v(v_every),
                **pg,
                **d,
                **options,
            )
            for suffix, v_every, options in (
                ("", 32, {}),
                ("-g0.5", 32, {"tracker_gamma": 0.5}),
                ("-c32", 32, {"tracker_chunk": 32}),
                # two magnitudes per chunk: 2 bits a value and 2 scales per 128 values, still within a tenth of DDP
                ("2", 32, {"tracker_levels": 2}),
                # the mean gradient sampled half as often, which frees the bytes for four magnitudes per 256 values
                # (3 bits a value); two magnitudes beside it separate the two changes
                ("2", 64, {"tracker_levels": 2}),
                ("4-c256", 64, {"tracker_levels": 4, "tracker_chunk": 256}),
            )
        ),
        *(
            c(
                f"pg4-it2-fp16-mtpg-sharedv32-b{beta1}",
                gradient_tracking="powergossip",
                beta1=beta1,
                **mt,
                **pg,
                **d,
                **shared_v(32),
            )
            for beta1 in (0.95, 0.99)
        ),
    ]


def _run_job(job: tuple[RunConfig, int, str]) -> dict[str, list[dict]]:
    torch.set_num_threads(1)
    config, seed, device = job
    try:
        return train_run(config, seed, device)
    except Exception as error:  # one failed run must not sink the sweep: record it
        return {"error": [{"config": config.name, "seed": seed, "error": f"{type(error).__name__}: {error}"}]}


def jobs_in_order(configs: list[RunConfig], seeds: list[int]) -> Iterator[tuple[RunConfig, int]]:
    """Configuration-major, in the suite's order of importance: a sweep cut short keeps whole configurations (every
    seed) of the head of the list rather than one seed of everything."""
    for config in configs:
        for seed in seeds:
            yield config, seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="study", choices=["smoke", "study"])
    parser.add_argument("--only", nargs="*", help="run only these configuration names")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="(configuration, seed) runs in parallel processes")
    parser.add_argument("--steps", type=int, help="override every configuration's steps (calibration, smoke tests)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--device", default="cpu", help="where the virtual ranks compute, e.g. cuda (one GPU shared)")
    args = parser.parse_args(argv)
    configs = suite(args.suite)
    if args.steps is not None:
        configs = [dataclasses.replace(c, steps=args.steps, warmup=min(c.warmup, args.steps // 2)) for c in configs]
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in configs})
        if unknown:
            parser.error(f"unknown configuration(s) {unknown}; the suite has {[c.name for c in configs]}")
        configs = [c for c in configs if c.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(config, seed, args.device) for config, seed in jobs_in_order(configs, args.seeds)]
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.jobs, maxtasksperchild=1) as pool:
        for done, result in enumerate(pool.imap_unordered(_run_job, jobs), 1):
            for kind, rows in result.items():
                append_rows(args.out / f"{kind}.csv", rows)
            head = result.get("summary", result.get("error"))[0]
            print(f"[{done}/{len(jobs)} {time.perf_counter() - started:.0f}s] {head}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
