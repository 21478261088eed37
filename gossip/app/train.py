r"""The training job behind ``gossip-train``: one worker's loop, from the resolved config to the run directory.

Every process is one worker of a decentralized run (docs/design.md B.1; Decent-DP's schema, arXiv 2410.11998):

.. math::  x_i^{t+1} = \sum_j W_{ij}(t)\, x_j^{t} \;-\; \eta_t\, d_i^{t}\big(g_i(x_i^{t})\big)

with :math:`W(t)` from the schedule, the mixing done by the algorithm (exact gossip, PowerGossip or All-Reduce;
with ``average_every = K > 0`` wrapped in :class:`gossip.PeriodicAverage`, an exact global average every K steps)
inside :class:`gossip.wrapper.parallel.DecentralizedDataParallel`, and :math:`d` the local optimizer's direction. The
learning rate :math:`\eta_t` warms up linearly for ``warmup_steps`` then follows a cosine to ``lr / 10``
(a ``torch.optim.lr_scheduler.LambdaLR``, :func:`make_scheduler`).

``algorithm="ddp"`` is the All-Reduce baseline as users run it: torch DistributedDataParallel (gradient all-reduce
overlapped with backward, :mod:`gossip.app.ddp_baseline`), no schedule; the loop is the same. ``algorithm="diloco"``
is the DiLoCo baseline (:class:`gossip.DiLoCo`): ``local_steps`` steps of the local optimizer, then an all-reduce of
the pseudo-gradient and an outer Nesterov-SGD step (``outer_lr``, ``outer_momentum``); it uses no schedule.

Rank 0 shows a progress bar and, at the end, a summary table and a text sample from the averaged model; it writes
``config.json``, ``metrics.csv`` and the plots into the run directory (see :mod:`gossip.app.run_dir`). Every rank
writes its own ``metrics_rank<r>.jsonl`` there (the wrapper's per-step metrics).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

import gossip
import optim
import topologies
from gossip.algorithms.diloco import LOCAL_STEPS, OUTER_LR, OUTER_MOMENTUM
from gossip.app.corpus import ShardedBatches, decode, encode, load_corpus, validation_batches
from gossip.app.ddp_baseline import DDPBaseline
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.outer_options import HYBRID_ALGORITHMS, check_outer_options, make_outer, resolve_outer
from gossip.app.run_dir import RunSummary, describe_mixing, prepare_run_dir, write_outputs
from gossip.backends.base import Communicator
from gossip.errors import ConfigError, NonFiniteError
from gossip.wrapper.mean_gradient import MEAN_GRADIENT_SOURCES
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.tracking import TRACKER_MIXINGS

logger = logging.getLogger(__name__)
MOMENTUM_TRACKING = "momentum-tracking-adamw"  # optim.MomentumTrackingAdamW: needs --gradient-tracking
OPTIMIZERS = ("accum-adamw", "adamw", MOMENTUM_TRACKING, "sgd")
DDP = "ddp"  # torch DistributedDataParallel: the All-Reduce baseline (gradient all-reduce, no schedule)
AVERAGING_EVERY_STEP = (DDP, "allreduce")  # --average-every changes nothing for these
DILOCO = "diloco"
#: The DiLoCo options and their defaults (gossip.DiLoCo's): they apply to --algorithm diloco only.
DILOCO_DEFAULTS = {"local_steps": LOCAL_STEPS, "outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM}
ALGORITHM_CHOICES = tuple(sorted([*gossip.ALGORITHMS, DDP]))
DEFAULT_SCHEDULE = "one_peer_hypercube"
FALLBACK_SCHEDULE = "base_graph"
PIPELINE = gossip.Pipeline()  # the library's default pipeline, which the main job's defaults follow
SAMPLE_PROMPT = "def "
SAMPLE_BYTES = 80


@dataclasses.dataclass(frozen=True)
class MixingDefaults:
    r"""The main job's default mixing and local optimizer, in one place: the library's default pipeline.

    They are :class:`gossip.Pipeline`'s (``gossip.wrap``): PowerGossip for the parameters, the first moments tracked
    by sign-compressed trackers (:class:`gossip.ChocoSign`), :class:`optim.MomentumTrackingAdamW` dividing by the
    mean gradient's second moment, sampled every ``second_moment_every`` steps and averaged by gossip (or, with
    ``--second-moment tracker``, read off the trackers every step); no outer step.
    :func:`resolve` fills them in where unset. ``optimizer`` and ``gradient_tracking`` apply to the gossip algorithms
    (exact gossip, PowerGossip) when neither an outer step nor a periodic average is asked for; DDP, DiLoCo and the
    hybrids (``--outer-every``) step with AdamW. The previous defaults, PowerGossip with an exact average of the
    replicas every 10 steps and AdamW, are ``--optimizer adamw --outer-every 10``. Why these values:
    docs/results.md, "The default pipeline".

    Attributes:
        algorithm: the mixing algorithm.
        rank: PowerGossip's rank.
        power_iterations: PowerGossip's power iterations per step.
        message_dtype: the dtype PowerGossip's products travel in.
        average_every: an exact global average every this many steps instead of the mixing (0: never).
        outer_every: an outer step every this many steps, on top of the mixing (0: never).
        outer_lr: a hybrid's outer learning rate (DiLoCo keeps its own, :data:`DILOCO_DEFAULTS`).
        outer_momentum: a hybrid's outer Nesterov momentum.
        optimizer: the local optimizer of the gossip algorithms.
        gradient_tracking: how the trackers are mixed (with ``optimizer``).
        second_moment: where the second moment comes from: ``"tracker"`` or ``"sample"``.
        second_moment_every: with ``"sample"``, the steps between two samples of the mean gradient.
        mean_gradient: how the sample is averaged.
        mean_gradient_dtype: the dtype a gossiped sample travels in.
        lr: the peak learning rate.
    """

    algorithm: str = "powergossip"
    rank: int = PIPELINE.rank
    power_iterations: int = PIPELINE.power_iterations
    message_dtype: str = str(PIPELINE.message_dtype).removeprefix("torch.")
    average_every: int = 0
    outer_every: int = 0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    optimizer: str = "momentum-tracking-adamw"
    gradient_tracking: str = PIPELINE.trackers
    second_moment: str = PIPELINE.second_moment
    second_moment_every: int = PIPELINE.second_moment_every
    mean_gradient: str = PIPELINE.mean_gradient
    mean_gradient_dtype: str = str(PIPELINE.mean_gradient_dtype).removeprefix("torch.")
    lr: float = 3e-3


DEFAULTS = MixingDefaults()
#: ``--message-dtype``: the dtype PowerGossip's products travel in (float32: the model's own).
MESSAGE_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass
class TrainConfig:
    """Everything one run depends on; ``None`` fields are resolved per world size by :func:`resolve`.

    Each field is the ``gossip-train`` option of the same name (``--batch-size`` for ``batch_size``, ...).

    Attributes:
        steps: optimizer steps per worker.
        batch_size: sequences per worker per step.
        lr: the peak learning rate.
        warmup_steps: linear warmup steps (None: :func:`default_warmup_steps`, ``steps // 10`` capped at 100).
        weight_decay: AdamW's weight decay, on matrices only.
        optimizer: the local optimizer, one of :data:`OPTIMIZERS` (None: :data:`DEFAULTS`' for exact gossip and
            PowerGossip without an outer step or a periodic average, else ``adamw``).
        accum_iter: AccumAdamW's accumulation (None: max(1, n // 4)).
        second_moment: MomentumTrackingAdamW's second moment, ``"tracker"`` (the mean gradient's, read off the
            trackers every step) or ``"sample"`` (from samples of the mean gradient); None: ``"sample"`` where
            ``second_moment_every`` is given, else :data:`DEFAULTS`'.
        second_moment_every: with ``"sample"``, the steps between two samples of the mean gradient's second
            moment (0: each rank's own second moment; None: :data:`DEFAULTS`'; 0 with ``"tracker"``).
        mean_gradient: how that sample is averaged: ``"gossip"`` over the schedule or ``"allreduce"`` (None:
            :data:`DEFAULTS`'; the wrapper's ``mean_gradient``).
        mean_gradient_dtype: the dtype a gossiped sample travels in, one of :data:`MESSAGE_DTYPES` (None:
            :data:`DEFAULTS`'; float32: the gradients' own; the wrapper's ``mean_gradient_dtype``).
        algorithm: the mixing algorithm (see :data:`ALGORITHM_CHOICES`).
        rank: PowerGossip's rank.
        power_iterations: PowerGossip's power iterations per step (None: :data:`DEFAULTS`').
        message_dtype: the dtype PowerGossip's products travel in, one of :data:`MESSAGE_DTYPES`.
        average_every: an exact global average every this many steps (0: never; None: :data:`DEFAULTS`').
        gradient_tracking: the optimizer steps on a tracker of the mean gradient, mixed like the parameters
            (``DecentralizedDataParallel(..., gradient_tracking=...)``): False (off), True or ``"exact"`` (one more
            exchange of model size per step), ``"powergossip"`` (PowerGossip at ``rank``, compressed products) or
            ``"sign"`` (:class:`gossip.ChocoSign`: scaled-sign messages with error feedback); None:
            :data:`DEFAULTS`' with the momentum-tracking optimizer, else off.
        tracking_overlap: the trackers' exchange overlaps forward and backward (combine-then-adapt tracking).
        tracker_hops: the trackers' exchanges a step, over W(kt), ..., W(kt + k - 1) (the wrapper's
            ``tracker_hops``; None: :func:`gossip.default_tracker_hops` of the world size with blocking trackers,
            else 1).
        delayed_last_iteration: PowerGossip's last power iteration is applied at the next step, so that its
            exchange overlaps that step's compute (``PowerGossip(delayed_last_iteration=True)``).
        local_steps: DiLoCo's local steps per round (None: :data:`DILOCO_DEFAULTS`' for DiLoCo).
        outer_lr: the outer learning rate (None: :data:`DILOCO_DEFAULTS`' for DiLoCo, :data:`DEFAULTS`' for a
            hybrid).
        outer_momentum: the outer Nesterov momentum (None: as ``outer_lr``).
        outer_sync: how the pseudo-gradients are averaged: allreduce, gossip or powergossip
            (:mod:`gossip.app.outer_options`; None: allreduce where an outer optimizer runs).
        outer_every: a hybrid: the per-step gossip algorithm and an outer step every this many steps (0: off;
            None: :data:`DEFAULTS`' for exact gossip and PowerGossip, unless ``average_every`` or
            ``delayed_last_iteration`` is given, which take its place; else 0).
        outer_delay: steps a synchronisation stays in flight (the delayed, streaming outer update; 0: none).
        outer_merge: with a delay, the weight of the replica's own progress when the average lands.
        schedule: the schedule name (None: :func:`gossip.default_schedule`).
        split: how the corpus is split between workers.
        seed: the seed of the model, the batches and the sampling.
        data: the text file to train on (None: the built-in corpus).
        backend: the communication backend (``auto`` picks one).
        timeout: seconds a communication may wait before it fails.
        out: the run directory (None: ``runs/<timestamp>``).
        eval_every: evaluate the averaged model every this many steps.
        eval_batches: validation batches per evaluation.
        log_every: steps between progress updates.
        shards: the ranks FSDP2 shards each replica over (``--shards``: :mod:`gossip.app.train_sharded`, whose
            ``world_size`` is then the number of replicas); None: one process per replica.
        world_size: the number of workers (set by :func:`resolve`).
        model: the :class:`~gossip.app.gpt.GPTConfig` fields.
    """

    steps: int = 500
    batch_size: int = 16
    lr: float = DEFAULTS.lr
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    optimizer: str | None = None
    accum_iter: int | None = None
    second_moment: str | None = None
    second_moment_every: int | None = None
    mean_gradient: str | None = None
    mean_gradient_dtype: str | None = None
    algorithm: str = DEFAULTS.algorithm
    rank: int = DEFAULTS.rank
    power_iterations: int | None = None
    message_dtype: str | None = None
    average_every: int | None = None
    gradient_tracking: bool | str | None = None
    tracking_overlap: bool = False
    tracker_hops: int | None = None
    delayed_last_iteration: bool = False
    local_steps: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_sync: str | None = None
    outer_every: int | None = None
    outer_delay: int = 0
    outer_merge: float | None = None
    schedule: str | None = None
    split: str = "iid"
    seed: int = 0
    data: str | None = None
    backend: str = "auto"
    timeout: float = 60.0
    out: str | None = None
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    shards: int | None = None
    world_size: int | None = None
    model: dict[str, Any] = dataclasses.field(default_factory=lambda: dataclasses.asdict(GPTConfig()))

    def to_json(self) -> dict[str, Any]:
        """The config as plain JSON data (what ``config.json`` holds).

        Returns:
            Every field, by name.
        """
        return dataclasses.asdict(self)


Replicated = DecentralizedDataParallel | DDPBaseline


def default_warmup_steps(steps: int) -> int:
    """The learning rate's linear warm-up for a run of ``steps``: a tenth of the run, at most 100 steps.

    Args:
        steps: the run's optimizer steps.

    Returns:
        ``min(100, steps // 10)``.
    """
    return min(100, steps // 10)


def build_schedule(config: TrainConfig) -> topologies.Schedule:
    """The schedule of ``config`` for its world size.

    Args:
        config: a resolved config.

    Returns:
        The schedule.

    Raises:
        ConfigError: naming ``--schedule``, when it is unknown or unusable for the world size.
    """
    try:
        schedule = topologies.by_name(config.schedule, config.world_size)
        symmetric = config.outer_sync == "powergossip" or config.gradient_tracking in ("powergossip", "sign")
        if gossip.ALGORITHMS[config.algorithm].needs_symmetric_schedule or symmetric:
            schedule.validate(symmetric=True)
    except topologies.ScheduleError as err:
        where = f"world size {config.world_size}, --algorithm {config.algorithm}"
        raise ConfigError("--schedule", f"{err} ({where})") from None
    return schedule


def resolve(config: TrainConfig, world_size: int) -> tuple[TrainConfig, list[str]]:
    """Fill the per-world-size defaults.

    ``accum_iter`` defaults to max(1, n // 4) (docs/design.md B.3: A ~ n/4 ... n/2); ``warmup_steps`` to
    ``steps // 10`` capped at 100; ``power_iterations``, ``message_dtype``, ``average_every`` and ``outer_every`` to
    :data:`DEFAULTS`' where they apply (else 1, float32, 0 and 0); ``local_steps``, ``outer_lr`` and
    ``outer_momentum`` to :data:`DILOCO_DEFAULTS` for DiLoCo, ``outer_lr`` and ``outer_momentum`` to
    :data:`DEFAULTS`' for a hybrid (else None).

    Args:
        config: the config as given.
        world_size: the number of workers.

    Returns:
        The resolved copy and notes on the choices made.

    Raises:
        ConfigError: naming the option at fault.
    """
    resolved = dataclasses.replace(config, world_size=world_size, model=dict(config.model))
    notes = []
    if config.algorithm == DDP:
        _check_ddp(config)
    elif config.schedule is None:
        resolved.schedule = gossip.default_schedule(world_size)
        if resolved.schedule != DEFAULT_SCHEDULE:
            notes.append(
                f"schedule: {resolved.schedule}, exact after {topologies.by_name(resolved.schedule, world_size).period}"
                f" steps ({DEFAULT_SCHEDULE} needs a power of two >= 2 workers)"
            )
    if config.accum_iter is None:
        resolved.accum_iter = max(1, world_size // 4)
    if config.warmup_steps is None:
        resolved.warmup_steps = default_warmup_steps(config.steps)
    if config.algorithm not in ALGORITHM_CHOICES:
        raise ConfigError("--algorithm", f"unknown {config.algorithm!r}; choose one of {list(ALGORITHM_CHOICES)}")
    if config.optimizer not in (None, *OPTIMIZERS):
        raise ConfigError("--optimizer", f"unknown {config.optimizer!r}; choose one of {list(OPTIMIZERS)}")
    if config.outer_every is None:
        resolved.outer_every = DEFAULTS.outer_every if config.algorithm in HYBRID_ALGORITHMS else 0
    _check_mixing_options(resolved)
    if config.gradient_tracking not in (None, False, True, *TRACKER_MIXINGS):
        raise ConfigError(
            "--gradient-tracking",
            f"must be off, on, 'exact', 'powergossip' or 'sign', got {config.gradient_tracking!r}",
        )
    _resolve_pipeline(config, resolved)
    if config.tracking_overlap and not resolved.gradient_tracking:
        raise ConfigError("--tracking-overlap", "overlaps the trackers' exchange: add --gradient-tracking")
    _resolve_tracker_hops(config, resolved)
    if resolved.optimizer == MOMENTUM_TRACKING and not resolved.gradient_tracking and config.algorithm != DDP:
        raise ConfigError(
            "--optimizer", f"{MOMENTUM_TRACKING} runs its first moment through the gradient trackers: add "
            "--gradient-tracking (exact, powergossip or sign)"
        )  # fmt: skip
    if config.power_iterations is None:
        resolved.power_iterations = DEFAULTS.power_iterations if config.algorithm == "powergossip" else 1
    _check_delayed_last_iteration(resolved)
    if config.message_dtype is None:
        resolved.message_dtype = DEFAULTS.message_dtype if config.algorithm == "powergossip" else "float32"
    if config.average_every is None:
        resolved.average_every = 0 if config.algorithm in (*AVERAGING_EVERY_STEP, DILOCO) else DEFAULTS.average_every
    if config.algorithm == DILOCO:
        for option, default in DILOCO_DEFAULTS.items():
            if getattr(config, option) is None:
                setattr(resolved, option, default)
    elif resolved.outer_every:
        for option in ("outer_lr", "outer_momentum"):
            if getattr(config, option) is None:
                setattr(resolved, option, getattr(DEFAULTS, option))
    check_outer_options(resolved)
    resolve_outer(resolved)
    if config.data is not None and not Path(config.data).is_file():
        raise ConfigError("--data", f"{config.data!r} does not exist or is not a file")
    if config.data is not None and Path(config.data).stat().st_size == 0:
        raise ConfigError("--data", f"{config.data!r} is empty; give a text file to train on")
    if resolved.algorithm != DDP:
        build_schedule(resolved)
    return resolved, notes


def _resolve_tracker_hops(config: TrainConfig, resolved: TrainConfig) -> None:
    """``tracker_hops`` where unset: the default pipeline's for the world size (:func:`gossip.default_tracker_hops`)
    with blocking trackers, else 1.

    Args:
        config: the config as given.
        resolved: its copy being resolved (``world_size`` and ``gradient_tracking`` already), changed in place.

    Raises:
        ConfigError: ``--tracker-hops`` is below 1, or above 1 without blocking trackers.
    """
    blocking = bool(resolved.gradient_tracking) and not config.tracking_overlap
    if config.tracker_hops is None:
        resolved.tracker_hops = PIPELINE.hops(resolved.world_size) if blocking else 1
    elif config.tracker_hops < 1:
        raise ConfigError("--tracker-hops", f"must be at least 1, got {config.tracker_hops}")
    elif config.tracker_hops > 1 and not blocking:
        raise ConfigError(
            "--tracker-hops", "mixes the trackers several times after the gradients: needs --gradient-tracking "
            "without --tracking-overlap"
        )  # fmt: skip


def _resolve_pipeline(config: TrainConfig, resolved: TrainConfig) -> None:
    """``optimizer``, ``gradient_tracking``, ``mean_gradient`` and its dtype where unset (:class:`MixingDefaults`).

    The default pipeline (momentum tracking with :data:`DEFAULTS`' trackers) for exact gossip and PowerGossip run
    without an outer step or a periodic average and without ``--no-gradient-tracking``; AdamW without trackers
    otherwise.

    Args:
        config: the config as given.
        resolved: its copy being resolved, changed in place.

    Raises:
        ConfigError: ``--mean-gradient`` given without the momentum-tracking optimizer, or unknown; or
            ``--mean-gradient-dtype`` unknown, or given for a sample that is not gossiped.
    """
    pipeline = (
        config.algorithm in HYBRID_ALGORITHMS
        and config.gradient_tracking is not False
        and not resolved.outer_every
        and not config.average_every
    )
    if config.optimizer is None:
        resolved.optimizer = DEFAULTS.optimizer if pipeline else "adamw"
    if config.gradient_tracking is None:
        resolved.gradient_tracking = DEFAULTS.gradient_tracking if resolved.optimizer == MOMENTUM_TRACKING else False
    if config.mean_gradient is not None:
        if config.mean_gradient not in MEAN_GRADIENT_SOURCES:
            raise ConfigError(
                "--mean-gradient", f"unknown {config.mean_gradient!r}; choose one of {list(MEAN_GRADIENT_SOURCES)}"
            )
        if resolved.optimizer != MOMENTUM_TRACKING:
            raise ConfigError(
                "--mean-gradient", f"applies to --optimizer {MOMENTUM_TRACKING} only, not {resolved.optimizer}"
            )
    else:
        resolved.mean_gradient = DEFAULTS.mean_gradient
    _resolve_second_moment(config, resolved)
    if config.mean_gradient_dtype is None:
        resolved.mean_gradient_dtype = DEFAULTS.mean_gradient_dtype
        return
    if config.mean_gradient_dtype not in MESSAGE_DTYPES:
        raise ConfigError(
            "--mean-gradient-dtype", f"unknown {config.mean_gradient_dtype!r}; choose one of {list(MESSAGE_DTYPES)}"
        )
    if resolved.optimizer != MOMENTUM_TRACKING or resolved.mean_gradient != "gossip":
        raise ConfigError(
            "--mean-gradient-dtype",
            f"applies to a gossiped sample (--optimizer {MOMENTUM_TRACKING} --mean-gradient gossip) only, not "
            f"--optimizer {resolved.optimizer} --mean-gradient {resolved.mean_gradient}",
        )


def _resolve_second_moment(config: TrainConfig, resolved: TrainConfig) -> None:
    """``second_moment`` and ``second_moment_every`` where unset: ``"sample"`` where ``--second-moment-every`` is
    given, else :data:`DEFAULTS`'; every :data:`DEFAULTS`' with ``"sample"``, 0 with ``"tracker"``.

    Args:
        config: the config as given.
        resolved: its copy being resolved, changed in place.

    Raises:
        ConfigError: ``--second-moment`` unknown or given for another optimizer, or ``"tracker"`` with
            ``--second-moment-every`` above 0.
    """
    every = config.second_moment_every
    if config.second_moment is not None and resolved.optimizer != MOMENTUM_TRACKING:
        raise ConfigError(
            "--second-moment", f"applies to --optimizer {MOMENTUM_TRACKING} only, not {resolved.optimizer}"
        )
    if config.second_moment is None:
        resolved.second_moment = DEFAULTS.second_moment if every is None else "sample"
    elif config.second_moment not in optim.SECOND_MOMENTS:
        raise ConfigError(
            "--second-moment", f"unknown {config.second_moment!r}; choose one of {list(optim.SECOND_MOMENTS)}"
        )
    if resolved.second_moment == "tracker":
        if every:
            raise ConfigError(
                "--second-moment-every",
                f"samples the mean gradient: with --second-moment tracker there is nothing to sample; add "
                f"--second-moment sample, or leave --second-moment-every {every} out",
            )
        resolved.second_moment_every = 0
    elif every is None:
        resolved.second_moment_every = DEFAULTS.second_moment_every


def sample_dtype(config: TrainConfig) -> torch.dtype | None:
    """The wrapper's ``mean_gradient_dtype`` for a resolved config.

    Args:
        config: the resolved config.

    Returns:
        The dtype ``--mean-gradient-dtype`` names; None for float32 (the gradients' own).
    """
    name = config.mean_gradient_dtype or DEFAULTS.mean_gradient_dtype
    return None if name == "float32" else getattr(torch, name)


def _check_mixing_options(config: TrainConfig) -> None:
    """``--average-every`` and ``--power-iterations``, where given, only where they change something."""
    every, iterations = config.average_every, config.power_iterations
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise ConfigError("--average-every", f"must be an integer >= 0 (0 = off), got {every!r}")
    if every and config.algorithm in AVERAGING_EVERY_STEP:
        raise ConfigError(
            "--average-every", f"--algorithm {config.algorithm} averages every step already; drop --average-every"
        )
    if every and config.algorithm == DILOCO:
        raise ConfigError(
            "--average-every", "--algorithm diloco synchronises every --local-steps steps; drop --average-every"
        )
    _check_diloco_options(config)
    if iterations is not None and iterations != 1 and config.algorithm != "powergossip":
        raise ConfigError(
            "--power-iterations",
            f"applies to --algorithm powergossip only, not {config.algorithm}; drop --power-iterations",
        )
    if config.message_dtype not in (None, *MESSAGE_DTYPES):
        raise ConfigError("--message-dtype", f"unknown {config.message_dtype!r}; choose one of {list(MESSAGE_DTYPES)}")
    if config.message_dtype not in (None, "float32") and config.algorithm != "powergossip":
        raise ConfigError(
            "--message-dtype",
            f"applies to --algorithm powergossip only, not {config.algorithm}; drop --message-dtype",
        )


def _check_delayed_last_iteration(config: TrainConfig) -> None:
    """``--delay-last-iteration``: PowerGossip run by the wrapper itself, with at least 2 power iterations."""
    if not config.delayed_last_iteration:
        return
    if config.algorithm != "powergossip":
        raise ConfigError("--delay-last-iteration", f"applies to --algorithm powergossip only, not {config.algorithm}")
    if config.power_iterations < 2:
        raise ConfigError(
            "--delay-last-iteration", "delays the last of several power iterations: add --power-iterations 2 or more"
        )
    if config.average_every or config.outer_every:
        option = "--average-every" if config.average_every else "--outer-every"
        raise ConfigError(
            "--delay-last-iteration", f"PowerGossip inside {option} cannot keep an exchange across steps; drop one"
        )


def _check_diloco_options(config: TrainConfig) -> None:
    """``--local-steps``, ``--outer-lr`` and ``--outer-momentum``: for DiLoCo only, and in range."""
    for option in DILOCO_DEFAULTS:
        hybrid = bool(config.outer_every) and option != "local_steps"  # a hybrid's period is --outer-every
        if getattr(config, option) is not None and config.algorithm != DILOCO and not hybrid:
            flag = "--" + option.replace("_", "-")
            where = "--algorithm diloco only" if option == "local_steps" else "--algorithm diloco or --outer-every only"
            raise ConfigError(flag, f"applies to {where}, not {config.algorithm}; drop {flag}")
    local_steps, outer_lr, outer_momentum = config.local_steps, config.outer_lr, config.outer_momentum
    if local_steps is not None and (type(local_steps) is not int or local_steps < 1):
        raise ConfigError("--local-steps", f"must be an integer >= 1, got {local_steps!r}")
    if outer_lr is not None and not 0 < outer_lr < math.inf:
        raise ConfigError("--outer-lr", f"must be positive and finite, got {outer_lr!r}")
    if outer_momentum is not None and not 0 <= outer_momentum < 1:
        raise ConfigError("--outer-momentum", f"must be in [0, 1), got {outer_momentum!r}")


def _check_ddp(config: TrainConfig) -> None:
    if config.schedule is not None:
        raise ConfigError(
            "--schedule", f"--algorithm ddp all-reduces over all workers; drop --schedule {config.schedule}"
        )
    if config.backend == "mpi":
        raise ConfigError(
            "--backend", "--algorithm ddp runs torch DistributedDataParallel, which needs Gloo or NCCL, not mpi"
        )
    if config.gradient_tracking:
        raise ConfigError(
            "--gradient-tracking", "--algorithm ddp all-reduces the gradients already; drop --gradient-tracking"
        )
    if config.optimizer == MOMENTUM_TRACKING:
        raise ConfigError(
            "--optimizer", f"--algorithm ddp all-reduces the gradients already; {MOMENTUM_TRACKING} is for gossip"
        )


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then a cosine from ``lr`` down to ``lr / 10`` at the last step.

    Args:
        config: a resolved config.
        step: the step (from 0).

    Returns:
        The learning rate of ``step``.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def make_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer) -> LambdaLR:
    """:func:`learning_rate` as a :class:`torch.optim.lr_scheduler.LambdaLR` (step it after each optimizer step).

    LambdaLR sets ``lr = base_lr * lr_lambda(step)``. The base is set to 1 and the lambda returns the learning rate
    itself, because ``1 * x`` is exactly ``x`` while ``lr * (x / lr)`` or ``lr * ((s + 1) / w)`` differ from the
    formula in the last bit for about a third of the warmup steps: this way the run is bit-identical to one that
    writes ``learning_rate(config, step)`` into the param groups.

    Args:
        config: a resolved config.
        optimizer: the optimizer whose groups' base learning rate is set to 1.

    Returns:
        The scheduler.
    """
    for group in optimizer.param_groups:
        group["lr"] = 1.0
    return LambdaLR(optimizer, lambda step: learning_rate(config, step))


def make_algorithm(config: TrainConfig) -> gossip.Algorithm:
    """The gossip algorithm of ``config``, wrapped where the config asks for it.

    In :class:`gossip.PeriodicAverage` when ``average_every > 0``; as the ``between`` of a
    :class:`gossip.OuterOptimizer` when ``outer_every > 0`` (:mod:`gossip.app.outer_options`).

    Args:
        config: a resolved config (not ``ddp``).

    Returns:
        The algorithm.
    """
    if config.algorithm == DILOCO:
        return make_outer(config, None)
    if config.algorithm == "powergossip":
        message_dtype = None if config.message_dtype == "float32" else getattr(torch, config.message_dtype)
        algorithm = gossip.PowerGossip(
            rank=config.rank,
            num_iterations=config.power_iterations,
            message_dtype=message_dtype,
            delayed_last_iteration=config.delayed_last_iteration,
        )
    else:
        algorithm = gossip.ALGORITHMS[config.algorithm]()
    if config.average_every:
        return gossip.PeriodicAverage(algorithm, every=config.average_every)
    if config.outer_every:
        return make_outer(config, algorithm)
    return algorithm


def tracking_option(config: TrainConfig) -> bool | gossip.Algorithm:
    """The wrapper's ``gradient_tracking`` for ``config``: False, True (exact), PowerGossip or ChocoSign.

    Args:
        config: a resolved config.

    Returns:
        What :class:`~gossip.wrapper.parallel.DecentralizedDataParallel` takes.
    """
    if config.gradient_tracking == "powergossip":
        return gossip.PowerGossip(rank=config.rank)
    if config.gradient_tracking == "sign":
        return gossip.ChocoSign()
    return bool(config.gradient_tracking)


def make_model(config: TrainConfig, comm: Communicator, run_dir: Path) -> Replicated:
    """The GPT wrapped for ``config.algorithm``: DecentralizedDataParallel, or DDPBaseline for ``ddp``. A collective.

    Args:
        config: a resolved config.
        comm: this worker's communicator.
        run_dir: the run directory (the per-rank metrics go there).

    Returns:
        The wrapped model.
    """
    module = GPT(GPTConfig(**config.model))
    if config.algorithm == DDP:
        return DDPBaseline(module, comm, run_dir=run_dir, consensus_every=config.eval_every)
    return DecentralizedDataParallel(
        module,
        comm,
        build_schedule(config),
        make_algorithm(config),
        run_dir=run_dir,
        consensus_every=config.eval_every,  # with the evaluation's collectives, never between them
        seed=config.seed,
        gradient_tracking=tracking_option(config),
        tracking_overlap=config.tracking_overlap,
        tracker_hops=config.tracker_hops,
        mean_gradient=config.mean_gradient,
        mean_gradient_dtype=sample_dtype(config),
    )


def make_optimizer(config: TrainConfig, module: torch.nn.Module) -> torch.optim.Optimizer:
    """The local optimizer ``--optimizer`` names, with weight decay on matrices only (:func:`optim.param_groups`).

    ``adamw`` is :class:`torch.optim.AdamW` and ``accum-adamw`` :class:`optim.AccumAdamW` with ``accum_iter``
    (its moments advance once per ``accum_iter`` steps; with 1 it is AdamW's update rule), and
    ``momentum-tracking-adamw`` :class:`optim.MomentumTrackingAdamW` with ``second_moment`` (its first
    moment goes through the wrapper's gradient trackers), all with betas (0.9, 0.95) and eps 1e-8; ``sgd`` is SGD
    with Nesterov momentum 0.9.

    Args:
        config: a resolved config.
        module: the model to optimize (create the optimizer after wrapping).

    Returns:
        The optimizer.
    """
    groups = optim.param_groups(module, config.weight_decay)
    if config.optimizer == "sgd":
        return optim.SGD(groups, lr=config.lr, momentum=0.9, nesterov=True)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)
    if config.optimizer == MOMENTUM_TRACKING:
        return optim.MomentumTrackingAdamW(
            groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, second_moment=config.second_moment,
            second_moment_every=config.second_moment_every,
        )  # fmt: skip
    return optim.AccumAdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, accum_iter=config.accum_iter)


def worker_threads(local_size: int) -> int:
    """Intra-op threads: ``OMP_NUM_THREADS`` when set, else max(1, cores // processes on this node).

    Args:
        local_size: the number of worker processes on this node.

    Returns:
        The number of threads.
    """
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // local_size)


@torch.no_grad()
def validation_loss(model: Replicated, batches: list, comm: Communicator) -> float:
    """Mean loss of the averaged model on the fixed validation batches; each rank evaluates a share. A collective.

    A sharded model passes its lane (``lanes.lane``): replica r evaluates every R-th batch, its shards running the
    same forwards (FSDP2's all-gathers are collectives of the replica), and the sums are all-reduced over the lane,
    so every lane, hence every rank, holds the same mean.

    Args:
        model: the wrapped model (replicated, or sharded).
        batches: the validation batches (the same on every rank).
        comm: this worker's communicator (a sharded model's lane communicator).

    Returns:
        The mean loss, the same on every rank.
    """
    totals = torch.zeros(2, dtype=torch.float64)
    with model.averaged() as module:
        module.eval()
        for x, y in batches[comm.rank :: comm.size]:
            totals[0] += module(x, y)[1].item()
            totals[1] += 1
        module.train()
    comm.all_reduce(totals, "sum")
    return float(totals[0] / totals[1])


def train_step(
    model: Replicated,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    scheduler: LRScheduler,
) -> float:
    """One step: forward, backward, optimizer step (the wrapper mixes inside it), scheduler step.

    Args:
        model: the wrapped model.
        optimizer: its optimizer.
        batch: the step's ``(x, y)``.
        scheduler: the learning-rate scheduler.

    Returns:
        The step's training loss.
    """
    x, y = batch
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.item()


def _progress(config: TrainConfig, rank: int) -> Any:
    if rank != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, desc="train", unit="step", mininterval=0.5, dynamic_ncols=True)


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """What :func:`run_steps` returns.

    Attributes:
        losses: this rank's training loss at every step.
        initial_validation: the averaged model's validation loss before the first step.
        final_validation: after the last step (``initial_validation`` without steps).
        seconds: the steps' wall time (the initial validation not included).
    """

    losses: list[float]
    initial_validation: float
    final_validation: float
    seconds: float


def run_steps(
    config: TrainConfig,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    batches: ShardedBatches,
    validate: Callable[[], float],
    rank: int,
    replicas: int,
    where: str,
) -> LoopResult:
    """The main job's training loop, replicated or sharded.

    The validation loss before the first step, then ``config.steps`` steps of :func:`train_step` on ``batches``,
    the validation loss every ``config.eval_every`` steps and at the last, each step logged with ``model.log``, a
    progress bar on rank 0.

    Args:
        config: the resolved config.
        model: the wrapped model (replicated or sharded).
        optimizer: its optimizer.
        scheduler: the learning-rate scheduler.
        batches: this replica's batches.
        validate: the validation loss of the averaged model (a collective: every rank calls it at the same steps).
        rank: this process's rank (rank 0 shows the progress).
        replicas: the replicas training (the tokens a step are theirs).
        where: who this is in an error message, e.g. ``"rank 3"``.

    Returns:
        The losses, the validation losses before the first step and after the last, and the steps' wall time.

    Raises:
        NonFiniteError: the training loss became NaN or Inf (lower ``--lr``).
    """
    initial_validation = final_validation = validate()
    progress = _progress(config, rank)
    tokens_per_step = replicas * config.batch_size * config.model["block_size"]
    started = time.perf_counter()
    losses: list[float] = []
    for step in range(config.steps):
        losses.append(train_step(model, optimizer, batches.batch(step), scheduler))
        if not math.isfinite(losses[-1]):
            raise NonFiniteError(f"{where}: training loss is {losses[-1]} at step {step}; lower --lr")
        row = {"loss": losses[-1], "elapsed_seconds": time.perf_counter() - started}
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            row["val_loss"] = final_validation = validate()
        model.log(**row)
        if progress is not None:
            progress.update(1)
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                rate = tokens_per_step * (step + 1) / row["elapsed_seconds"]
                progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", refresh=False)
    if progress is not None:
        progress.close()
    return LoopResult(losses, initial_validation, final_validation, time.perf_counter() - started)


def train(config: TrainConfig) -> RunSummary | None:
    """Run one worker of the job described by ``config``.

    A job with ``config.shards`` set runs :func:`gossip.app.train_sharded.train_sharded` instead (the command line
    picks it).

    Args:
        config: the config (resolved here for the world size).

    Returns:
        The run's summary on rank 0, None elsewhere.

    Raises:
        ConfigError: an option cannot work for this run.
        NonFiniteError: the training loss became NaN or Inf (lower ``--lr``).
    """
    if config.shards is not None:
        raise ConfigError("--shards", "train() runs unsharded replicas; train_sharded(config) runs shards")
    comm = gossip.init(config.backend, timeout=config.timeout)
    try:
        return _train(config, comm)
    finally:
        comm.close()


def _train(config: TrainConfig, comm: Communicator) -> RunSummary | None:
    torch.set_num_threads(worker_threads(comm.local_size))
    config, notes = resolve(config, comm.size)
    run_dir = prepare_run_dir(config, comm)
    if comm.rank == 0:
        for note in notes:
            logger.info(note)
    corpus = load_corpus(config.data, block_size=config.model["block_size"])
    torch.manual_seed(config.seed)
    model = make_model(config, comm, run_dir)
    optimizer = make_optimizer(config, model.module)
    scheduler = make_scheduler(config, optimizer)
    batches = ShardedBatches(
        corpus.train, comm.rank, comm.size, config.batch_size, config.model["block_size"], config.seed, config.split
    )
    held_out = validation_batches(corpus.validation, config.batch_size, config.model["block_size"], config.eval_batches)
    if comm.rank == 0:
        logger.info(
            "gossip-train: %d worker(s), %s, %s, GPT %s params, corpus %s (%s bytes), run dir %s",
            comm.size,
            describe_mixing(config),
            config.optimizer,
            f"{model.module.num_parameters():,}",
            corpus.source,
            f"{len(corpus.train):,}",
            run_dir,
        )
    loop = run_steps(
        config, model, optimizer, scheduler, batches, lambda: validation_loss(model, held_out, comm),
        comm.rank, comm.size, f"rank {comm.rank}",
    )  # fmt: skip
    consensus = model.consensus_distance()
    sample = _sample(model, config.seed, comm.rank)
    all_losses = comm.all_gather_object(loop.losses)
    traffic = model.close()
    if comm.rank != 0:
        return None
    summary = RunSummary(
        config=config,
        losses_by_rank=all_losses,
        initial_val_loss=loop.initial_validation,
        final_val_loss=loop.final_validation,
        consensus_distance=consensus,
        train_seconds=loop.seconds,
        traffic=traffic or {},
        sample=sample,
    )
    write_outputs(run_dir, summary)
    return summary


def _sample(model: Replicated, seed: int, rank: int) -> str | None:
    """SAMPLE_BYTES bytes generated by the averaged model after SAMPLE_PROMPT, on rank 0. A collective."""
    with model.averaged() as module:
        return generate_sample(module, seed) if rank == 0 else None


def generate_sample(module: GPT, seed: int) -> str:
    """SAMPLE_BYTES bytes that ``module`` generates after SAMPLE_PROMPT with ``seed`` (the global RNG restored).

    Args:
        module: the model to sample (in training mode again afterwards).
        seed: the sampling seed.

    Returns:
        The generated text, prompt included.
    """
    module.eval()
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    tokens = module.generate(encode(SAMPLE_PROMPT)[None], SAMPLE_BYTES, temperature=0.8, top_k=40)
    torch.set_rng_state(generator_state)
    module.train()
    return decode(tokens[0])
