"""``gossip-train`` / ``python -m gossip``: train the small byte-level GPT with decentralized (gossip) training.

Two ways to run it:

* ``gossip-train --nproc 4`` starts 4 local worker processes on Gloo through torch's elastic launcher (as
  ``torchrun --standalone``; ``OMP_NUM_THREADS = max(1, cores // 4)``) and waits for them. If one fails, the others
  are stopped and the job exits 1 with that worker's error; SIGTERM/SIGINT to the launcher reach the workers.
* Without ``--nproc`` the command is one worker, as launched: ``mpirun -n 8 gossip-train``,
  ``srun gossip-train``, ``torchrun --nproc-per-node 4 -m gossip`` or a single process (``gossip.init`` reads the
  launcher's environment).

Defaults (:data:`gossip.app.train.DEFAULTS`, the library's default pipeline, :class:`gossip.Pipeline`): PowerGossip
at rank 4 with 2 power iterations per step and its products in float16 on one_peer_hypercube (base_graph when the
number of workers is not a power of two: one peer a step, exact after one period), each worker's first moment
tracked by sign-compressed trackers (:class:`gossip.ChocoSign`) and :class:`optim.MomentumTrackingAdamW` dividing by
the mean gradient's second moment, sampled every 64 steps and averaged by gossip; no collective between the first
step and the end but the evaluations (``--eval-every``). 500 steps of 16 x 64 bytes per worker, lr 3e-3 with warmup
and cosine decay. What it reaches against DDP and DiLoCo: docs/results.md. The previous defaults, PowerGossip with an
exact average of the replicas every 10 steps and AdamW, are ``--optimizer adamw --outer-every 10``;
``--algorithm exact --optimizer accum-adamw`` (accum_iter = max(1, n // 4)) runs exact gossip with AccumAdamW.

Baselines: ``--algorithm ddp`` (torch DistributedDataParallel) and ``--algorithm diloco`` (DiLoCo: ``--local-steps``
H = 20 local AdamW steps, then an all-reduce of the pseudo-gradient and an outer Nesterov SGD step, ``--outer-lr``
0.7, ``--outer-momentum`` 0.9; 1/H of DDP's bytes).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import gossip
import optim
import topologies
from gossip.app.arg_types import int_at_least, positive
from gossip.app.local_launch import ERROR_DIR_VARIABLE, launch_local, worker_argv
from gossip.app.outer_options import add_outer_options, outer_settings
from gossip.app.train import (
    ALGORITHM_CHOICES,
    DEFAULTS,
    MESSAGE_DTYPES,
    OPTIMIZERS,
    ConfigError,
    TrainConfig,
    resolve,
    train,
)
from gossip.wrapper.mean_gradient import MEAN_GRADIENT_SOURCES
from gossip.wrapper.pipeline import ONE_HOP_UP_TO
from gossip.wrapper.tracking import TRACKER_MIXINGS


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _kill(text: str) -> tuple[int, int]:
    from gossip.app.elastic_launch import parse_kill

    try:
        return parse_kill(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help only where it says something.

    Not when the help already states the default in its own words (it mentions "default"), and not when X is None
    (resolved later).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``gossip-train`` argument parser.

    Returns:
        The parser; its defaults are :class:`~gossip.app.train.TrainConfig`'s.
    """
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="gossip-train",
        description="Decentralized (gossip) training of a small byte-level GPT.",
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    launch = parser.add_argument_group("launch")
    launch.add_argument("--nproc", type=positive(int), help="start N local workers on Gloo (else: as launched)")
    launch.add_argument("--backend", choices=gossip.BACKENDS, default=defaults.backend, help="communication backend")
    launch.add_argument("--timeout", type=positive(float), default=defaults.timeout, help="seconds per wait")
    launch.add_argument(
        "--elastic", action="store_true", help="survive dead workers: drop them and train on (with --nproc)"
    )
    launch.add_argument(
        "--shards", type=positive(int), default=None,
        help="shard each replica over G workers with FSDP2 and gossip between the replicas, shard to shard "
        "(world = replicas x G; exact gossip and AdamW; docs/guide/sharded.md)",
    )  # fmt: skip
    launch.add_argument(
        "--kill", type=_kill, action="append", default=[], metavar="RANK@STEP",
        help="(--elastic) worker RANK SIGKILLs itself at step STEP; repeatable",
    )  # fmt: skip
    launch.add_argument(
        "--restart", type=_kill, action="append", default=[], metavar="RANK@STEP",
        help="(--elastic, after --kill RANK@K, K < STEP) the launcher starts worker RANK again once its departure is "
        "agreed; it joins from a neighbour when the group reaches step STEP; repeatable",
    )  # fmt: skip
    launch.add_argument(
        "--nnodes", type=positive(int), default=1,
        help="(--elastic --nproc) nodes of the job, one launcher each; node 0's MASTER_ADDR and MASTER_PORT host the "
        "membership store",
    )  # fmt: skip
    launch.add_argument(
        "--node-rank", type=int_at_least(0), default=0, help="(--elastic --nproc --nnodes) this node, in [0, nnodes)"
    )
    launch.add_argument(
        "--save-replicas", action="store_true",
        help="(--elastic) each member writes its parameters to OUT/replicas/ at every --eval-every step",
    )  # fmt: skip
    gossip_options = parser.add_argument_group("gossip")
    gossip_options.add_argument(
        "--algorithm",
        choices=ALGORITHM_CHOICES,
        default=defaults.algorithm,
        help="how replicas are mixed; ddp: torch DistributedDataParallel (gradient all-reduce, no --schedule); "
        "diloco: DiLoCo (--local-steps local steps, then an outer Nesterov step on the mean pseudo-gradient)",
    )
    gossip_options.add_argument(
        "--schedule",
        choices=topologies.names(),
        default=None,
        help="default: one_peer_hypercube, or ring when the worker count is not a power of two",
    )
    gossip_options.add_argument("--rank", type=positive(int), default=defaults.rank, help="PowerGossip rank")
    gossip_options.add_argument(
        "--power-iterations",
        type=positive(int),
        default=None,
        help=f"PowerGossip power iterations (exchanges) per step; default: {DEFAULTS.power_iterations}",
    )
    gossip_options.add_argument(
        "--message-dtype",
        choices=MESSAGE_DTYPES,
        default=None,
        help="dtype of PowerGossip's products on the wire (float32: the model's; float16 / bfloat16: half the "
        "bytes); "
        f"default: {DEFAULTS.message_dtype}",
    )
    gossip_options.add_argument(
        "--delay-last-iteration",
        action="store_true",
        help="PowerGossip with 2 or more power iterations: apply the last one at the next step, so that its "
        "exchange overlaps that step's forward and backward instead of completing before the optimizer step "
        "(changes the result); default: off",
    )
    gossip_options.add_argument(
        "--average-every",
        type=int_at_least(0),
        default=None,
        help="exact global average (all-reduce) every K steps instead of gossip (gossip.PeriodicAverage); 0 = off; "
        f"default: {DEFAULTS.average_every} (0 for ddp and allreduce)",
    )
    gossip_options.add_argument(
        "--gradient-tracking",
        nargs="?",
        const=True,
        default=None,
        choices=TRACKER_MIXINGS,
        metavar="{exact,powergossip,sign}",
        help="step on a tracker of the mean gradient, mixed like the parameters: exactly (the flag alone or exact: "
        "one more exchange of model size per step), by PowerGossip at --rank (powergossip: its compressed "
        "products per step) or by CHOCO-Gossip with scaled-sign messages (sign: gossip.ChocoSign, 3 bits a value "
        "and error feedback); the trackers' sum stays the gradients' sum; needs a doubly stochastic (powergossip, "
        f"sign: symmetric) schedule; default: {DEFAULTS.gradient_tracking} with --optimizer {DEFAULTS.optimizer}, "
        "else off",
    )
    gossip_options.add_argument(
        "--tracking-overlap",
        action="store_true",
        help="with --gradient-tracking: the trackers' exchange runs during forward and backward (DIGing's "
        "combine-then-adapt tracker: y_i = sum_j W_ij y_j(t-1) + g_i(t) - g_i(t-1)) instead of blocking the "
        "optimizer step; default: off",
    )
    gossip_options.add_argument(
        "--tracker-hops",
        type=int_at_least(1),
        default=None,
        help="with blocking --gradient-tracking: the trackers' exchanges a step, over the schedule's next W each "
        f"(k times the trackers' bytes); default with blocking trackers: 1 up to {ONE_HOP_UP_TO} workers, else "
        "ceil(log2(n) / 2) + 1 (3 up to 16 workers, 4 up to 64, 5 up to 256); "
        "else 1",
    )
    gossip_options.add_argument(
        "--no-gradient-tracking",
        dest="gradient_tracking",
        action="store_const",
        const=False,
        help="gradient tracking off (and --optimizer adamw unless given)",
    )
    add_outer_options(parser, hybrid_lr=DEFAULTS.outer_lr, hybrid_momentum=DEFAULTS.outer_momentum)
    training = parser.add_argument_group("training")
    training.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="local update rule: adamw is torch.optim.AdamW, accum-adamw optim.AccumAdamW (moments advance once per "
        "--accum-iter steps), momentum-tracking-adamw optim.MomentumTrackingAdamW (its first moment goes through "
        "the gradient trackers: needs --gradient-tracking), sgd Nesterov SGD; default: momentum-tracking-adamw for "
        "exact and powergossip without --outer-every or --average-every, else adamw",
    )
    training.add_argument("--accum-iter", type=positive(int), default=None, help="default: max(1, workers // 4)")
    training.add_argument(
        "--second-moment",
        choices=optim.SECOND_MOMENTS,
        default=None,
        help="momentum-tracking-adamw: where its second moment comes from: tracker (the mean gradient's, read off "
        "the trackers every step; no message) or sample (samples of the mean gradient every "
        f"--second-moment-every steps); default: {DEFAULTS.second_moment}; --second-moment-every implies sample",
    )
    training.add_argument(
        "--second-moment-every",
        type=int_at_least(0),
        default=None,
        help="momentum-tracking-adamw with --second-moment sample: steps between two samples of the mean "
        f"gradient's second moment; 0 keeps each worker's own; default: {DEFAULTS.second_moment_every}",
    )
    training.add_argument(
        "--mean-gradient",
        choices=MEAN_GRADIENT_SOURCES,
        default=None,
        help="momentum-tracking-adamw: how each sample of the mean gradient is averaged: gossip (over the schedule, "
        "one hop a step beside the parameters' exchange, exact after log2 n hops of the hypercube; no collective) "
        f"or allreduce (at once; a collective over every worker); default: {DEFAULTS.mean_gradient} "
        "(allreduce with --elastic)",
    )
    training.add_argument(
        "--mean-gradient-dtype",
        choices=MESSAGE_DTYPES,
        default=None,
        help="momentum-tracking-adamw with --mean-gradient gossip: the dtype each hop of the sample travels in "
        "(float32: the gradients'; both ends of a hop round alike, so every worker gets the same mean); default: "
        f"{DEFAULTS.mean_gradient_dtype}",
    )
    training.add_argument("--steps", type=positive(int), default=defaults.steps, help="optimizer steps")
    training.add_argument("--batch-size", type=positive(int), default=defaults.batch_size, help="per worker")
    training.add_argument("--lr", type=positive(float), default=defaults.lr, help="peak learning rate")
    training.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="on matrices only")
    training.add_argument("--seed", type=int, default=defaults.seed, help="model init, batches, sampling")
    training.add_argument("--split", choices=("iid", "noniid"), default=defaults.split, help="data per worker")
    training.add_argument("--data", default=None, help="a text file to train on (default: Python stdlib source)")
    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>)")
    output.add_argument(
        "--eval-every", type=positive(int), default=defaults.eval_every, help="steps between validation losses"
    )
    output.add_argument(
        "--log-every",
        type=positive(int),
        default=defaults.log_every,
        help="steps between progress-bar updates (the consensus distance is estimated with each --eval-every)",
    )
    return parser


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The :class:`~gossip.app.train.TrainConfig` of parsed options (not yet resolved for a world size).

    Args:
        args: what :func:`build_parser`'s parser returned.

    Returns:
        The config.
    """
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        optimizer=args.optimizer,
        accum_iter=args.accum_iter,
        second_moment=args.second_moment,
        second_moment_every=args.second_moment_every,
        mean_gradient=args.mean_gradient,
        mean_gradient_dtype=args.mean_gradient_dtype,
        algorithm=args.algorithm,
        rank=args.rank,
        power_iterations=args.power_iterations,
        message_dtype=args.message_dtype,
        average_every=args.average_every,
        gradient_tracking=args.gradient_tracking,
        tracking_overlap=args.tracking_overlap,
        tracker_hops=args.tracker_hops,
        delayed_last_iteration=args.delay_last_iteration,
        **outer_settings(args),
        schedule=args.schedule,
        split=args.split,
        seed=args.seed,
        data=args.data,
        backend=args.backend,
        timeout=args.timeout,
        out=args.out,
        eval_every=args.eval_every,
        log_every=args.log_every,
        shards=args.shards,
    )


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int | None) -> None:
    if args.weight_decay < 0:
        parser.error(f"argument --weight-decay: must be >= 0, got {args.weight_decay}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be >= 0, got {args.seed}")
    if world_size is not None and args.shards is not None:
        from gossip.app.train_sharded import resolve_sharded

        try:
            resolve_sharded(config_from(args), world_size)
        except ConfigError as err:
            parser.error(f"argument {err}")
    elif world_size is not None:
        try:
            resolve(config_from(args), world_size)
        except ConfigError as err:
            parser.error(f"argument {err}")


def _validate_restarts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--restart`` and ``--save-replicas`` need ``--elastic``; a restart needs a kill before it (a ConfigError)."""
    from gossip.app.elastic_launch import check_restarts

    for option, given in (("--restart", args.restart), ("--save-replicas", args.save_replicas)):
        if given and not args.elastic:
            parser.error(f"argument {option}: needs --elastic")
    ranks = [rank for rank, _ in args.restart]
    if len(set(ranks)) < len(ranks):
        parser.error(f"argument --restart: a worker is restarted at most once, got {ranks}")
    try:
        check_restarts(dict(args.kill), dict(args.restart), args.nproc and args.nproc * args.nnodes, args.steps)
    except ConfigError as err:
        parser.error(f"argument {err}")


def _validate_nodes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, int] | None:
    """``--nnodes`` / ``--node-rank``: elastic launchers only; several nodes need node 0's MASTER_ADDR/PORT."""
    if args.nnodes == 1 and args.node_rank == 0:
        return None
    if not (args.elastic and args.nproc):
        parser.error("argument --nnodes/--node-rank: needs --elastic and --nproc (one elastic launcher per node)")
    if args.node_rank >= args.nnodes:
        parser.error(f"argument --node-rank: {args.node_rank} is outside [0, {args.nnodes})")
    if args.restart:
        parser.error("argument --restart: runs on one node (--nnodes 1)")
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not address or not port.isdigit():
        parser.error("argument --nnodes: several nodes need MASTER_ADDR and MASTER_PORT set to node 0's address and a "
                     "free port there (the membership store)")  # fmt: skip
    return address, int(port)


def _show_library_messages() -> None:
    """The library logs its notes (``logging``, logger ``gossip``); the command shows them on stdout."""
    library = logging.getLogger("gossip")
    if not library.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        library.addHandler(handler)
        library.setLevel(logging.INFO)


def run_worker(args: argparse.Namespace) -> int:
    """Train as one worker of the job as launched; print the summary on rank 0.

    Args:
        args: the parsed options.

    Returns:
        0 on success, 1 on error (the error is printed).
    """
    _show_library_messages()
    try:
        rank = gossip.detect_launch().rank
    except gossip.LaunchError as err:
        print(f"gossip-train: {err}", file=sys.stderr, flush=True)
        return 1
    try:
        if args.elastic:
            from gossip.app.train_elastic import train_elastic

            summary = train_elastic(config_from(args), dict(args.kill), dict(args.restart), args.save_replicas)
        else:
            config = config_from(args)
            if config.shards is not None:
                from gossip.app.train_sharded import train_sharded

                summary = train_sharded(config)
            else:
                summary = train(config)
    except Exception as err:
        message = f"rank {rank}: {type(err).__name__}: {err}"
        traceback.print_exc()
        print(f"gossip-train: {message}", file=sys.stderr, flush=True)
        if os.environ.get(ERROR_DIR_VARIABLE):
            (Path(os.environ[ERROR_DIR_VARIABLE]) / f"rank{rank}.txt").write_text(message + "\n")
        return 1
    if summary is not None:
        from gossip.app.run_dir import summary_table

        print("\nsummary:\n" + summary_table(summary), flush=True)
        if summary.sample is not None:
            print(f"\nsample from the averaged model:\n{summary.sample}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``gossip-train`` command.

    Args:
        argv: the command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shards is not None and args.elastic:
        parser.error("argument --shards: not with --elastic (the sharded replicas have no elastic membership yet)")
    _validate(parser, args, args.nproc)
    if args.kill and not args.elastic:
        parser.error("argument --kill: needs --elastic (without it, a dead worker stops the job)")
    _validate_restarts(parser, args)
    master = _validate_nodes(parser, args)
    if args.nproc is not None:
        if args.backend not in ("auto", "gloo"):
            parser.error(f"argument --backend: --nproc starts Gloo workers; got --backend {args.backend}")
        out = args.out or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        if args.elastic:
            from gossip.app.elastic_launch import launch_elastic

            command = [sys.executable, "-m", "gossip", *worker_argv(argv, out)]
            return launch_elastic(args.nproc, command, dict(args.kill), say=_to_stderr, restarts=dict(args.restart),
                                  nodes=args.nnodes, node_rank=args.node_rank, master=master)  # fmt: skip
        return launch_local(args.nproc, argv, out, _to_stderr)
    code = run_worker(args)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.elastic:
        # Groups abandoned with a dead peer may still hold a receive that will never complete; their teardown at
        # interpreter exit can abort the process. Everything is written and flushed: leave at once.
        os._exit(code)
    if code != 0 and gossip.detect_launch().size > 1:
        # A failed job: leave at once, without the teardown that would wait for peers that are not coming.
        # A successful one exits normally, so that MPI_Finalize runs when mpi4py initialised MPI (under
        # mpiexec, also for Gloo, whose address is broadcast over MPI): without it, Hydra reports a BAD
        # TERMINATION and kills the ranks still writing their output.
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
