r"""The main job on sharded replicas (``gossip-train --nproc 4 --shards 2``): R replicas x G shards, gossip by lane.

The world of N = R G workers is laid out on a ``("replicate", "shard")`` DeviceMesh (:mod:`gossip.backends.lanes`):
world rank :math:`r G + j` holds shard j of replica r. Each replica's GPT is sharded by FSDP2
(``torch.distributed.fsdp.fully_shard``, each block then the root) over ``mesh["shard"]`` only, so FSDP's
reduce-scatter averages the gradient within replica r and never across replicas; the replicas are then mixed by
:class:`gossip.ShardedDecentralizedDataParallel`, shard j of every replica with shard j of the others (lane j),
over the same W(t) of the R replicas in every lane (docs/design.md B.1, with :math:`x_i` a replica):

.. math::  x_{i,j}^{t+1} = \sum_k W_{ik}(t)\, x_{k,j}^{t} \;-\; \eta_t\, d_{i,j}^{t}

By default this is the job's default pipeline on the shards: PowerGossip in block mode (its rank per local shard
of a matrix, so the mixing of a replica has rank up to G times that), the first moments tracked by sign-compressed
trackers of the local shards, and ``optim.MomentumTrackingAdamW`` on FSDP2's DTensors with the mean gradient's
second moment gossiped lane by lane. With ``--algorithm exact`` the mixing is an element-wise weighted sum, so the
job is, term by term, the unsharded job of R workers with the same options: the data are split over the R replicas
as the unsharded job splits them over R workers (the G shards of a replica read the same batch,
:class:`gossip.app.corpus.ShardedBatches` with the replica index), the model and the schedule are those of R
workers, and the averaged model is evaluated on the same validation batches (each replica a share, its shards
together). The loss, the learning rate and the evaluation are those of :mod:`gossip.app.train`.

What the sharded wrapper does not run is refused by name before any process group starts
(:func:`check_sharded`): DDP, DiLoCo and the other algorithms, the combine-then-adapt trackers, a periodic average
or an outer step, ``--elastic``, MPI, and a world size that ``--shards`` does not divide.

Outputs: rank 0 writes the run directory as the unsharded job does (``config.json`` with ``shards``,
``metrics.csv`` with one loss per replica averaged, the plots). Lane 0's ranks write ``metrics_rank<r>.jsonl``
(r = replica) there, lane j > 0's into ``lane<j>/``: every lane samples the consensus distance together, since it
is summed over the shard group; bytes are per rank, i.e. one shard's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gossip
from gossip.app.corpus import ShardedBatches, load_corpus, validation_batches
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.run_dir import RunSummary, describe_mixing, prepare_run_dir, write_outputs
from gossip.app.train import (
    MOMENTUM_TRACKING,
    TrainConfig,
    build_schedule,
    generate_sample,
    make_algorithm,
    make_optimizer,
    make_scheduler,
    resolve,
    run_steps,
    sample_dtype,
    tracking_option,
    validation_loss,
    worker_threads,
)
from gossip.backends.base import Communicator
from gossip.backends.lanes import Lanes, init_lanes
from gossip.errors import ConfigError
from gossip.wrapper.sharded import ShardedDecentralizedDataParallel

logger = logging.getLogger(__name__)
#: the algorithms the sharded wrapper runs on the shards (PowerGossip in block mode: its rank per local shard)
SHARDED_ALGORITHMS = ("exact", "powergossip")
#: the local optimizers the sharded job runs on FSDP2's DTensor shards
SHARDED_OPTIMIZERS = ("adamw", MOMENTUM_TRACKING)


def check_sharded(config: TrainConfig, processes: int) -> int:
    """Refuse what the sharded job cannot run, naming the option; return the number of replicas.

    Args:
        config: the config as given (before :func:`~gossip.app.train.resolve`), ``shards`` (G) set.
        processes: the number of worker processes, N.

    Returns:
        R = N / G.

    Raises:
        ConfigError: naming ``--shards``, ``--algorithm``, ``--optimizer``, ``--tracking-overlap``,
            ``--average-every``, ``--outer-every`` or ``--backend``, and what to do.
    """
    shards = config.shards
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ConfigError("--shards", f"must be an integer >= 1, got {shards!r}")
    if processes % shards != 0:
        raise ConfigError(
            "--shards",
            f"{processes} workers cannot form replicas of {shards} shards each: the world is replicas x shards; "
            f"choose --nproc a multiple of {shards}",
        )
    if config.algorithm not in (None, *SHARDED_ALGORITHMS):
        raise ConfigError(
            "--algorithm",
            f"--shards runs ShardedDecentralizedDataParallel, which mixes the shards with {list(SHARDED_ALGORITHMS)}, "
            f"not {config.algorithm}",
        )
    if config.tracking_overlap:
        raise ConfigError("--tracking-overlap", "--shards runs the trackers adapt-then-combine (the default); drop it")
    if config.optimizer not in (None, *SHARDED_OPTIMIZERS):
        raise ConfigError(
            "--optimizer",
            f"--shards steps {list(SHARDED_OPTIMIZERS)} on the shards, not {config.optimizer}",
        )
    for option, value in (("--average-every", config.average_every), ("--outer-every", config.outer_every)):
        if value:
            raise ConfigError(option, "--shards: the sharded wrapper mixes every step, without an average; drop it")
    if config.backend == "mpi":
        raise ConfigError(
            "--backend", "--shards: FSDP2 needs a torch.distributed process group; use --backend gloo (or nccl)"
        )
    return processes // shards


def resolve_sharded(config: TrainConfig, processes: int) -> tuple[TrainConfig, list[str]]:
    """:func:`check_sharded`, then :func:`~gossip.app.train.resolve` for the R replicas.

    The job's defaults apply: the default pipeline, its PowerGossip in block mode.

    Args:
        config: the config as given, ``shards`` set.
        processes: N = R G.

    Returns:
        The resolved copy (``world_size`` = R) and the notes on the choices made.

    Raises:
        ConfigError: naming the option at fault.
    """
    return resolve(config, check_sharded(config, processes))


def shard_gpt(config: TrainConfig, mesh: Any) -> GPT:
    """The main job's GPT, sharded by FSDP2 over ``mesh["shard"]``: each block, then the root (embeddings, ln_f).

    Args:
        config: a resolved config (its ``model`` fields).
        mesh: the ``("replicate", "shard")`` DeviceMesh.

    Returns:
        The module, its parameters ``Shard(0)`` DTensors over this rank's replica.
    """
    module = GPT(GPTConfig(**config.model))
    for block in module.blocks:
        fully_shard(block, mesh=mesh["shard"])
    # the root too reshards after its forward (FSDP2 keeps a root's parameters unsharded by default): the wrapper
    # fills and writes back the shards between steps and evaluations, and must find them registered then
    fully_shard(module, mesh=mesh["shard"], reshard_after_forward=True)
    return module


def train_sharded(config: TrainConfig) -> RunSummary | None:
    """Run one worker of the sharded job: ``config.shards`` ranks per replica, as many replicas as the world holds.

    Args:
        config: the config as given (resolved here), ``shards`` set.

    Returns:
        The run's summary on world rank 0, None elsewhere.

    Raises:
        ConfigError: an option the sharded job cannot run (:func:`check_sharded`).
        NonFiniteError: the training loss became NaN or Inf (lower ``--lr``).
    """
    comm = gossip.init(config.backend, timeout=config.timeout)
    try:
        return _train(config, comm)
    finally:
        comm.close()


def _train(config: TrainConfig, comm: Communicator) -> RunSummary | None:
    torch.set_num_threads(worker_threads(comm.local_size))
    config, notes = resolve_sharded(config, comm.size)
    replicas, shards = config.world_size, config.shards
    run_dir = prepare_run_dir(config, comm)
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    lanes = init_lanes(mesh, timeout=config.timeout)
    try:
        return _train_lanes(config, comm, lanes, run_dir, mesh, notes)
    finally:
        lanes.lane.close()
        lanes.shard.close()


def _train_lanes(
    config: TrainConfig, comm: Communicator, lanes: Lanes, run_dir: Path, mesh: Any, notes: list[str]
) -> RunSummary | None:
    replica, shard = lanes.lane.rank, lanes.shard.rank
    lane_dir = run_dir if shard == 0 else run_dir / f"lane{shard}"
    lane_dir.mkdir(parents=True, exist_ok=True)
    if comm.rank == 0:
        for note in notes:
            logger.info(note)
    corpus = load_corpus(config.data, block_size=config.model["block_size"])
    torch.manual_seed(config.seed)
    model = ShardedDecentralizedDataParallel(
        shard_gpt(config, mesh),
        lanes,
        build_schedule(config),
        make_algorithm(config),
        gradient_tracking=tracking_option(config),
        tracker_hops=config.tracker_hops,
        mean_gradient=config.mean_gradient,
        mean_gradient_dtype=sample_dtype(config),
        run_dir=lane_dir,
        consensus_every=config.eval_every,  # with the evaluation's collectives, never between them
        seed=config.seed,
    )
    optimizer = make_optimizer(config, model.module)
    scheduler = make_scheduler(config, optimizer)
    block = config.model["block_size"]
    replicas = lanes.lane.size
    batches = ShardedBatches(corpus.train, replica, replicas, config.batch_size, block, config.seed, config.split)
    held_out = validation_batches(corpus.validation, config.batch_size, block, config.eval_batches)
    if comm.rank == 0:
        logger.info(
            "gossip-train: %d replica(s) x %d shard(s), %s, %s, GPT %s params, corpus %s (%s bytes), run dir %s",
            lanes.lane.size,
            lanes.shard.size,
            describe_mixing(config),
            config.optimizer,
            f"{model.module.num_parameters():,}",
            corpus.source,
            f"{len(corpus.train):,}",
            run_dir,
        )
    where = f"rank {comm.rank} (replica {replica}, shard {shard})"
    loop = run_steps(
        config, model, optimizer, scheduler, batches, lambda: validation_loss(model, held_out, lanes.lane),
        comm.rank, lanes.lane.size, where,
    )  # fmt: skip
    consensus = model.consensus_distance()
    sample = _sample(model, config.seed, replica, comm.rank)
    every_rank = comm.all_gather_object(loop.losses)
    traffic = model.close()
    if comm.rank != 0:
        return None
    summary = RunSummary(
        config=config,
        losses_by_rank=[every_rank[r * config.shards] for r in range(lanes.lane.size)],  # shard 0 of each replica
        initial_val_loss=loop.initial_validation,
        final_val_loss=loop.final_validation,
        consensus_distance=consensus,
        train_seconds=loop.seconds,
        traffic=traffic or {},
        sample=sample,
    )
    write_outputs(run_dir, summary)
    return summary


def _sample(model: ShardedDecentralizedDataParallel, seed: int, replica: int, rank: int) -> str | None:
    """SAMPLE_BYTES bytes from the averaged model after SAMPLE_PROMPT: replica 0's shards generate together (the
    same seed, so the same tokens on each); world rank 0 returns them. A collective (``averaged()``)."""
    with model.averaged() as module:
        if replica != 0:
            return None
        text = generate_sample(module, seed)
        return text if rank == 0 else None
