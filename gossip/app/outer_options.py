"""The main job's outer-optimizer options: how DiLoCo's pseudo-gradients travel, hybrids, the delayed outer update.

``--algorithm diloco`` is :class:`gossip.DiLoCo` (an all-reduce of the pseudo-gradients every ``--local-steps``
steps). The options here turn it, or a per-step gossip algorithm, into a :class:`gossip.OuterOptimizer`:

* ``--outer-sync allreduce|gossip|powergossip``: how the pseudo-gradients are averaged (``gossip``:
  :class:`gossip.ExactGossip` over ``--schedule``; ``powergossip``: :class:`gossip.PowerGossip` at ``--rank`` with
  one power iteration and float32 products);
* ``--outer-every H`` with ``--algorithm exact|powergossip``: a hybrid, that algorithm every step and an outer step
  every H steps (``--outer-lr``, ``--outer-momentum`` apply);
* ``--outer-delay τ``: each synchronisation lands τ steps after it started, overlapping their compute (Streaming
  DiLoCo); ``--outer-merge a`` is then the weight of the replica's own progress.
"""

from __future__ import annotations

import argparse
from typing import Any

import gossip
from gossip.algorithms.diloco import LOCAL_STEPS, OUTER_LR, OUTER_MOMENTUM
from gossip.app.arg_types import in_unit_interval, int_at_least, positive
from gossip.errors import ConfigError

OUTER_SYNCS = ("allreduce", "gossip", "powergossip")
#: The algorithms a hybrid (``--outer-every``) runs every step.
HYBRID_ALGORITHMS = ("exact", "powergossip")
#: ``--outer-merge`` when ``--outer-delay`` is given without it: the mixing factor of Streaming DiLoCo.
DEFAULT_MERGE = 0.5


def add_outer_options(parser: argparse.ArgumentParser, *, hybrid_lr: float, hybrid_momentum: float) -> None:
    """Add the outer-optimizer options (DiLoCo's and the hybrids', one group) to the ``gossip-train`` parser.

    Args:
        parser: the parser.
        hybrid_lr: a hybrid's default outer learning rate (DiLoCo's is :data:`gossip.algorithms.diloco.OUTER_LR`).
        hybrid_momentum: a hybrid's default outer momentum.
    """
    group = parser.add_argument_group("outer optimizer (--algorithm diloco, or a hybrid with --outer-every)")
    group.add_argument(
        "--local-steps",
        type=positive(int),
        default=None,
        help=f"(diloco) local steps between two synchronisations (H); default: {LOCAL_STEPS}",
    )
    group.add_argument(
        "--outer-lr",
        type=positive(float),
        default=None,
        help=f"learning rate of the outer Nesterov SGD; default: {OUTER_LR} for diloco, {hybrid_lr:g} for a hybrid",
    )
    group.add_argument(
        "--outer-momentum",
        type=in_unit_interval(include_one=False),
        default=None,
        help=f"momentum of the outer Nesterov SGD, in [0, 1); default: {OUTER_MOMENTUM} for diloco, "
        f"{hybrid_momentum:g} for a hybrid",
    )
    group.add_argument(
        "--outer-sync",
        choices=OUTER_SYNCS,
        default=None,
        help="how the pseudo-gradients are averaged: allreduce (DiLoCo), gossip (exact gossip over --schedule), "
        "powergossip (PowerGossip at --rank over --schedule); default: allreduce",
    )
    group.add_argument(
        "--outer-every",
        metavar="H",
        type=int_at_least(0),
        default=None,
        help="with --algorithm exact or powergossip: keep that gossip every step and take an outer step every H "
        "steps (a hybrid, with AdamW unless --optimizer says otherwise; with --outer-lr 1 and --outer-momentum 0 "
        "an exact average of the replicas; --outer-every 10 was the main job before issue 59); 0 = off; default: 0",
    )
    group.add_argument(
        "--outer-delay",
        metavar="TAU",
        type=int_at_least(0),
        default=0,
        help="steps a synchronisation stays in flight, overlapping their compute (Streaming DiLoCo's tau), below "
        "the steps between synchronisations; 0 = lands in its own step; default: 0",
    )
    group.add_argument(
        "--outer-merge",
        metavar="A",
        type=in_unit_interval(include_one=True),
        default=None,
        help="with --outer-delay: when the average lands, the replica becomes theta + a (x - theta); 0 drops the "
        f"delayed local steps; default: {DEFAULT_MERGE}",
    )


def outer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~gossip.app.train.TrainConfig` fields of the parsed outer-optimizer options.

    Args:
        args: the parsed options.

    Returns:
        ``local_steps``, ``outer_lr``, ``outer_momentum``, ``outer_sync``, ``outer_every``, ``outer_delay``,
            ``outer_merge``.
    """
    return {
        "local_steps": args.local_steps,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "outer_sync": args.outer_sync,
        "outer_every": args.outer_every,
        "outer_delay": args.outer_delay,
        "outer_merge": args.outer_merge,
    }


def uses_outer(config: Any) -> bool:
    """Whether ``config`` runs an outer optimizer: DiLoCo, or a hybrid (``outer_every`` > 0).

    Args:
        config: a :class:`~gossip.app.train.TrainConfig`.

    Returns:
        True when it does.
    """
    return config.algorithm == "diloco" or bool(config.outer_every)


def period(config: Any) -> int | None:
    """The steps between synchronisations: ``local_steps`` for DiLoCo, ``outer_every`` for a hybrid.

    Args:
        config: a :class:`~gossip.app.train.TrainConfig`.

    Returns:
        H, or None when not resolved or no outer optimizer runs.
    """
    return config.local_steps if config.algorithm == "diloco" else (config.outer_every or None)


def check_outer_options(config: Any) -> None:
    """Refuse an outer-optimizer option out of range, or given where it changes nothing.

    Args:
        config: the config as given.

    Raises:
        ConfigError: naming the option at fault.
    """
    every, delay, merge, sync = config.outer_every, config.outer_delay, config.outer_merge, config.outer_sync
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError("--outer-every", f"must be an integer >= 0 (0 = off), got {every!r}")
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ConfigError("--outer-delay", f"must be an integer >= 0, got {delay!r}")
    if merge is not None and not (isinstance(merge, (int, float)) and 0 <= merge <= 1):
        raise ConfigError("--outer-merge", f"must be in [0, 1], got {merge!r}")
    if sync is not None and sync not in OUTER_SYNCS:
        raise ConfigError("--outer-sync", f"unknown {sync!r}; choose one of {list(OUTER_SYNCS)}")
    if every and config.algorithm not in HYBRID_ALGORITHMS:
        raise ConfigError(
            "--outer-every",
            f"a hybrid runs --algorithm {' or '.join(HYBRID_ALGORITHMS)} every step, not {config.algorithm} "
            "(--algorithm diloco synchronises every --local-steps steps)",
        )
    if every and config.average_every:
        raise ConfigError("--average-every", "--outer-every takes an outer step instead; drop one of them")
    if not uses_outer(config):
        for flag, value in (("--outer-sync", sync), ("--outer-delay", delay), ("--outer-merge", merge)):
            if value:
                raise ConfigError(
                    flag, f"applies to --algorithm diloco or --outer-every only, not {config.algorithm}; drop {flag}"
                )
    if merge is not None and not delay:
        raise ConfigError("--outer-merge", "applies with --outer-delay only (nothing lands late without it)")
    steps = period(config)
    if delay and steps is not None and delay >= steps:
        raise ConfigError(
            "--outer-delay", f"must be below the {steps} steps between synchronisations (one in flight), got {delay}"
        )


def resolve_outer(config: Any) -> None:
    """Fill ``outer_sync`` (allreduce) and ``outer_merge`` (:data:`DEFAULT_MERGE` with a delay) in place.

    Args:
        config: the resolved config, changed in place; untouched when no outer optimizer runs.
    """
    if not uses_outer(config):
        return
    if config.outer_sync is None:
        config.outer_sync = "allreduce"
    if config.outer_merge is None and config.outer_delay:
        config.outer_merge = DEFAULT_MERGE


def make_outer(config: Any, per_step: gossip.Algorithm | None) -> gossip.Algorithm:
    """The outer optimizer of ``config``.

    :class:`gossip.DiLoCo` when it is plain DiLoCo, else an :class:`gossip.OuterOptimizer` with ``per_step`` as
    ``between``.

    Args:
        config: a resolved config that runs an outer optimizer.
        per_step: the hybrid's per-step algorithm, None for DiLoCo.

    Returns:
        The algorithm.
    """
    settings = {"outer_lr": config.outer_lr, "outer_momentum": config.outer_momentum}
    if per_step is None and config.outer_sync == "allreduce" and not config.outer_delay:
        return gossip.DiLoCo(local_steps=config.local_steps, **settings)
    averaging = {
        "allreduce": gossip.AllReduce,
        "gossip": gossip.ExactGossip,
        "powergossip": lambda: gossip.PowerGossip(rank=config.rank),
    }[config.outer_sync]()
    return gossip.OuterOptimizer(
        averaging,
        period(config),
        **settings,
        between=per_step,
        delay=config.outer_delay,
        merge=config.outer_merge or 0.0,
    )


def describe_outer(config: Any) -> str:
    """The outer optimizer in words, for the run's description.

    Args:
        config: a resolved config that runs an outer optimizer.

    Returns:
        E.g. "outer Nesterov SGD lr 0.7 momentum 0.9 every 50 steps on gossip-averaged pseudo-gradients", or
            "exact average every 10 steps (outer step, lr 1, no momentum)" for the defaults' outer step.
    """
    exact = config.outer_sync == "allreduce" and not config.outer_delay  # a delayed one merges, not replaces
    if exact and config.outer_lr == 1 and config.outer_momentum == 0:
        text = f"exact average every {period(config)} steps (outer step, lr 1, no momentum)"
    else:
        text = (
            f"outer Nesterov SGD lr {config.outer_lr:g} momentum {config.outer_momentum:g} every {period(config)} steps"
        )
    if config.outer_sync != "allreduce":
        text += f" on {config.outer_sync}-averaged pseudo-gradients"
    if config.outer_delay:
        text += f", landing {config.outer_delay} step(s) late (merge {config.outer_merge:g})"
    return text
