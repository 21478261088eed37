"""One worker of ``gossip-train --elastic``: the main job's training, surviving dead peers.

Launched by ``gossip-train --nproc N --elastic`` (:mod:`gossip.app.elastic_launch`), which hosts the membership
store and reports a worker's exit at once. The loop is :func:`gossip.app.train.train_step`'s, driven through
:class:`gossip.wrapper.elastic_run.ElasticRun`: ``before_step`` at the top of each step, ``update`` for the
optimizer step. ``--kill RANK@STEP`` makes worker RANK SIGKILL itself at the top of step STEP -- its exchange of
that step is already posted, so the kill lands mid-exchange, with no clean-up, as a node loss would; workers killed
at the same step die together (:func:`gossip.app.elastic_launch.die_together`).

Elastic settings: PowerGossip runs one power iteration and no periodic average unless given (real-process elastic
needs one exchange per step); the default schedule is the main job's (:func:`gossip.default_schedule`:
``one_peer_hypercube`` for a power of two, else ``base_graph``), and after a change the same family over the new
size or its fallback (:func:`gossip.wrapper.elastic.schedule_for`);
gradient tracking restarts the trackers at every change (each at its own last input) and runs blocking (no
``--tracking-overlap``), and momentum tracking's sample of the mean gradient is taken once a step at most, skipped
where a change interrupts it (:class:`gossip.wrapper.elastic_run.ElasticRun`); the sampled consensus distance is off
(the wrapper's all-reduce in its step bookkeeping, outside what :class:`gossip.wrapper.elastic_run.ElasticRun`
resolves at a change; :meth:`~gossip.wrapper.elastic_run.ElasticRun.consensus_distance` is the elastic one); the data
shards stay those of the original ranks (a departed worker's shard is not reassigned). The summary is written by the
lowest surviving member; its ``result.json`` has a ``membership`` list naming who left, when, and the new schedule.

A worker started again with the same command, ``RANK`` and ``GOSSIP_ELASTIC_STORE`` (the launcher prints it) joins
the run from a neighbour at the group's next step boundary; it writes no per-step metrics file, and the summary's
per-step losses are those of the workers that took every step. With ``--restart RANK@STEP`` the launcher restarts
it (:mod:`gossip.app.elastic_launch`): it waits until the group reached STEP (the members wait for it there),
then joins, and logs the step it joined at.

``--save-replicas``: at every ``--eval-every`` step (and the last), each member writes its parameters to
``<out>/replicas/<step>_<uid>.pt`` (the step, the uid, the members and the module's state dict), so that the
averaged model of whoever was a member then can be evaluated afterwards (a mid-run evaluation of the averaged
model would be a collective, which a membership change may interrupt).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import time
import warnings
from pathlib import Path

import torch

from gossip.algorithms.base import Algorithm
from gossip.app.corpus import ShardedBatches, load_corpus, validation_batches
from gossip.app.elastic_launch import die_together, hold_for_joiners, wait_for_step
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.run_dir import RunSummary, prepare_run_dir, write_outputs
from gossip.app.train import (
    TrainConfig,
    _sample,
    build_schedule,
    make_algorithm,
    make_optimizer,
    make_scheduler,
    resolve,
    tracking_option,
    validation_loss,
    worker_threads,
)
from gossip.backends.elastic_comm import open_epoch
from gossip.backends.membership import STORE_VARIABLE, connect
from gossip.errors import ConfigError, ElasticUnsupportedError, NonFiniteError
from gossip.wrapper.elastic import schedule_for, solo_communicator
from gossip.wrapper.elastic_run import ElasticRun
from gossip.wrapper.parallel import DecentralizedDataParallel

logger = logging.getLogger("gossip")


def resolve_elastic(config: TrainConfig, world_size: int) -> tuple[TrainConfig, list[str]]:
    """:func:`gossip.app.train.resolve`, with the elastic defaults (see the module docstring).

    Args:
        config: the config as given.
        world_size: the number of workers at the start.

    Returns:
        The resolved config and notes.

    Raises:
        ElasticUnsupportedError: a backend other than Gloo (MPI cannot shrink a communicator without ULFM).
        ConfigError: an option elastic runs cannot take (``--average-every``, ``--outer-every``,
            ``--power-iterations`` > 1, ``--tracking-overlap``, ``--tracker-hops`` > 1, ``--mean-gradient gossip``,
            DDP or DiLoCo).
    """
    if config.backend not in ("auto", "gloo"):
        raise ElasticUnsupportedError(
            f"--elastic runs on Gloo only, not --backend {config.backend}: an MPI communicator cannot shrink without "
            "ULFM (and NCCL groups are not rebuilt here); without --elastic a dead peer fails the job fast, named"
        )
    if config.algorithm not in ("exact", "powergossip"):
        raise ConfigError("--algorithm", f"--elastic runs exact or powergossip, not {config.algorithm}")
    if config.average_every:
        raise ConfigError("--average-every", "--elastic cannot run a periodic global average (a collective)")
    if config.outer_every:
        raise ConfigError("--outer-every", "--elastic cannot run an outer step (it synchronises every rank)")
    if config.power_iterations not in (None, 1):
        raise ConfigError("--power-iterations", "--elastic runs one power iteration per step")
    if config.tracking_overlap:
        raise ConfigError("--tracking-overlap", "--elastic runs the blocking tracker (one exchange after the mixing)")
    if config.mean_gradient == "gossip":
        raise ConfigError("--mean-gradient", "--elastic samples the mean gradient by allreduce (a change skips it)")
    if config.tracker_hops not in (None, 1):
        raise ConfigError("--tracker-hops", "--elastic mixes the trackers once a step (one exchange after the mixing)")
    elastic = dataclasses.replace(
        config, average_every=0, outer_every=0, power_iterations=1, mean_gradient="allreduce", tracker_hops=1
    )
    return resolve(elastic, world_size)


def save_replica(run_dir: Path, step: int, uid: int, members: tuple[int, ...], module: torch.nn.Module) -> Path:
    """Write this member's parameters after ``step`` steps (``--save-replicas``), atomically.

    Args:
        run_dir: the run directory.
        step: the number of steps taken.
        uid: this member.
        members: the members of its epoch.
        module: its model.

    Returns:
        The file written: ``<run_dir>/replicas/<step>_<uid>.pt``.
    """
    folder = run_dir / "replicas"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step:06d}_{uid}.pt"
    partial = path.with_suffix(".partial")
    torch.save({"step": step, "uid": uid, "members": list(members), "state": module.state_dict()}, partial)
    partial.replace(path)
    return path


def train_elastic(
    config: TrainConfig, kills: dict[int, int], restarts: dict[int, int] | None = None, save_replicas: bool = False
) -> RunSummary | None:
    """Run one elastic worker of the job ``config`` describes.

    Args:
        config: the config (resolved here).
        kills: worker uid -> the step at whose top it SIGKILLs itself.
        restarts: worker uid -> the step a restarted worker joins at (``--restart``; see the module docstring).
        save_replicas: write each member's parameters at every ``eval_every`` step (see the module docstring).

    Returns:
        The summary on the lowest surviving member, None elsewhere.

    Raises:
        ElasticUnsupportedError: no membership store in the environment (not launched with ``--elastic``).
        NonFiniteError: the training loss became NaN or Inf.
        MembershipError: restarted, but the group ended before reaching the restart's step.
    """
    if STORE_VARIABLE not in os.environ:
        raise ElasticUnsupportedError(
            f"--elastic needs the membership store ({STORE_VARIABLE}): launch with gossip-train --nproc N --elastic"
        )
    uid, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(worker_threads(size))
    config, notes = resolve_elastic(config, size)
    membership = connect(os.environ[STORE_VARIABLE], uid, timeout=config.timeout)
    joining = membership.joining  # restarted with the same command: join from a neighbour
    holder: list[DecentralizedDataParallel] = []
    if joining:
        comm, schedule = solo_communicator(config.timeout), schedule_for(config.schedule, 1)[0]
        run_dir = Path(config.out)
    else:
        comm = open_epoch(membership, 0, membership.current.members, config.timeout,
                          lambda: holder[0].step_count if holder else 0)  # fmt: skip
        schedule = build_schedule(config)
        run_dir = prepare_run_dir(config, comm)
    for note in notes if uid == 0 else []:
        logger.info(note)
    corpus = load_corpus(config.data, block_size=config.model["block_size"])
    torch.manual_seed(config.seed)
    module, algorithm = GPT(GPTConfig(**config.model)), make_algorithm(config)
    tracking = tracking_option(config)
    model = DecentralizedDataParallel(  # a joiner writes no per-step metrics (its rank-0 file would be uid 0's)
        module, comm, schedule, algorithm, run_dir=None if joining else run_dir, consensus_every=0, seed=config.seed,
        gradient_tracking=tracking, mean_gradient="allreduce",  # an elastic step's sample: one skippable collective
    )  # fmt: skip
    holder.append(model)
    optimizer = make_optimizer(config, model.module)
    scheduler = make_scheduler(config, optimizer)
    trackers = (lambda: tracking_option(config)) if isinstance(tracking, Algorithm) else None
    elastic = ElasticRun(model, optimizer, membership, schedule=config.schedule,
                         algorithm=lambda: make_algorithm(config), timeout=config.timeout,
                         tracker=trackers)  # fmt: skip
    batches = ShardedBatches(corpus.train, uid, size, config.batch_size, config.model["block_size"], config.seed,
                             config.split)  # fmt: skip
    held_out = validation_batches(corpus.validation, config.batch_size, config.model["block_size"], config.eval_batches)
    if uid == 0:
        logger.info("gossip-train --elastic: %d worker(s), schedule %s, run dir %s", size, config.schedule, run_dir)
    restarts = restarts or {}
    if joining:
        if uid in restarts:
            wait_for_step(membership.store, uid, restarts[uid], membership.interval)
        elastic.join()
        logger.info("gossip-train --elastic: member %d joined at step %d (donor: %s)", uid, model.step_count,
                    elastic.events[-1]["joined"].get(str(uid)) if elastic.events else "none")  # fmt: skip
        scheduler.last_epoch = model.step_count - 1
        with warnings.catch_warnings():  # stepped before any optimizer step, on purpose
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()  # the learning rate of the step it joins at
        initial_validation = math.nan  # the group measured it at the start
    else:
        initial_validation = validation_loss(model, held_out, comm)
    started, losses = time.perf_counter(), []
    joiners_at: dict[int, list[int]] = {}
    for restarted, at in restarts.items():
        joiners_at.setdefault(at, []).append(restarted)
    while model.step_count < config.steps:
        step = model.step_count
        elastic.before_step()
        if kills.get(uid) == step:
            together = sum(at == step for at in kills.values())
            if together > 1:
                die_together(membership.store, step, together, config.timeout)
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: as a node loss
        if step in joiners_at:  # once per restart step: let the restarted workers join here
            late = hold_for_joiners(membership.store, uid, step, joiners_at[step], membership.changed, config.timeout)
            if late:
                logger.info("member %d: at step %d, restarted worker(s) %s not ready yet", uid, step, late)
        x, y = batches.batch(step)
        _, loss = model(x, y)
        loss.backward()
        elastic.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise NonFiniteError(f"member {uid}: training loss is {losses[-1]} at step {step}; lower --lr")
        model.log(loss=losses[-1], elapsed_seconds=time.perf_counter() - started, members=len(elastic.members))
        if save_replicas and (model.step_count % config.eval_every == 0 or model.step_count == config.steps):
            save_replica(run_dir, model.step_count, uid, elastic.members, model.module)
    elastic.finish()
    train_seconds = time.perf_counter() - started
    comm = model.comm
    final_validation = validation_loss(model, held_out, comm)
    consensus = model.consensus_distance()
    sample = _sample(model, config.seed, comm.rank)
    # a joiner trained fewer steps: the summary's per-step means are over the workers that took every step
    all_losses = [mine for mine in comm.all_gather_object(losses) if len(mine) == config.steps]
    moved: dict[int, int] = {}  # epoch -> bytes handed over (known to the donors and joiners only)
    for events in comm.all_gather_object(elastic.events):
        for event in events:
            moved[event["epoch"]] = max(moved.get(event["epoch"], 0), event["handover_bytes"])
    events = [{**event, "handover_bytes": moved.get(event["epoch"], 0)} for event in elastic.events]
    traffic = model.close()
    membership.close()
    if comm.rank != 0:
        return None
    summary = RunSummary(config=config, losses_by_rank=all_losses, initial_val_loss=initial_validation,
                         final_val_loss=final_validation, consensus_distance=consensus, train_seconds=train_seconds,
                         traffic=traffic or {}, sample=sample)  # fmt: skip
    write_elastic_outputs(run_dir, summary, uid, events)
    return summary


def write_elastic_outputs(run_dir: Path, summary: RunSummary, uid: int, events: list[dict]) -> None:
    """The run's outputs, with the membership changes in ``result.json``, ``membership.json`` and ``membership.png``.

    ``membership.png`` marks the curve where each new member set began.

    The curves and ``metrics.csv`` come from ``metrics_rank0.jsonl``: when member 0 did not survive, only
    ``result.json`` is written.

    Args:
        run_dir: the run directory.
        summary: the run's summary.
        uid: the writing member.
        events: the membership changes (:attr:`ElasticRun.events`).
    """
    if uid == 0:
        write_outputs(run_dir, summary)
        result = json.loads((run_dir / "result.json").read_text())
    else:
        result = {**summary.numbers(), "sample": summary.sample}
    result["membership"] = events
    if uid == 0 and events:
        _mark_changes(run_dir, events)
    for event in events:
        left = ", ".join(f"{u} ({how})" for u, how in event["left"].items()) or "nobody"
        logger.info(
            "membership: epoch %d: left %s, noticed at step %d; %d members from step %d on %s",
            event["epoch"], left, event["noticed_at_step"], len(event["members"]), event["resume_step"],
            event["schedule"],
        )  # fmt: skip
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (run_dir / "membership.json").write_text(json.dumps(events, indent=2) + "\n")


def _mark_changes(run_dir: Path, events: list[dict]) -> None:
    """``membership.png``: the mean training loss against step, a dashed line where each new member set began."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(run_dir / "metrics.csv", newline="") as file:
        rows = [(int(row["step"]), float(row["mean_loss"])) for row in csv.DictReader(file)]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    axis.plot([step for step, _ in rows], [loss for _, loss in rows], label="train loss (mean over the survivors)")
    for event in events:
        left = ", ".join(event["left"]) or "-"
        joined = ", ".join(event["joined"]) or "-"
        axis.axvline(event["resume_step"], color="grey", linestyle="--")
        axis.text(event["resume_step"], axis.get_ylim()[1], f" left {left}, joined {joined}: {len(event['members'])}",
                  va="top", fontsize=8, rotation=90)  # fmt: skip
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats / byte)")
    axis.legend()
    figure.savefig(run_dir / "membership.png", dpi=100)
    plt.close(figure)
