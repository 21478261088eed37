"""The main job's local launcher (``gossip-train --nproc N``): N workers of the same command on Gloo, through torch's
elastic launcher, and the worker to blame when they fail.

A worker that fails writes its error to ``$GOSSIP_TRAIN_ERROR_DIR/rank<r>.txt``; the launcher blames a worker that did
not merely lose a peer (:func:`root_cause`) and prints how it ended (:func:`exit_description`).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

ERROR_DIR_VARIABLE = "GOSSIP_TRAIN_ERROR_DIR"  # workers of --nproc write rank<r>.txt there when they fail
LAUNCHER_OPTIONS = ("--nproc", "--out", "--backend", "--nnodes", "--node-rank")


def worker_argv(argv: Sequence[str], out: str) -> list[str]:
    """A worker's command line: the launcher's own, without the launcher's options.

    Args:
        argv: the launcher's arguments.
        out: the run directory the workers share.

    Returns:
        ``argv`` without :data:`LAUNCHER_OPTIONS` (``--opt V`` or ``--opt=V``), then ``--out out --backend gloo``.
    """
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in LAUNCHER_OPTIONS:
            skip = True
        elif not item.startswith(tuple(f"{option}=" for option in LAUNCHER_OPTIONS)):
            kept.append(item)
    return [*kept, "--out", out, "--backend", "gloo"]


def exit_description(code: int) -> str:
    """How a worker process ended, in words for the launcher's report.

    Args:
        code: the process's exit code (negative: the signal that killed it).

    Returns:
        "killed by SIGKILL" (or another signal's name) or "exited with status N".
    """
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def root_cause(failed: dict[int, int], errors: Path) -> tuple[int, str]:
    """The failed rank to blame: one that did not merely lose a peer (timeout or closed connection), if any.

    Args:
        failed: each failed rank's exit code.
        errors: the directory the workers wrote their errors to (``rank<r>.txt``).

    Returns:
        The rank and its error message (or a pointer to its output when it wrote none).
    """
    messages = {}
    for rank in failed:
        error_file = errors / f"rank{rank}.txt"
        messages[rank] = error_file.read_text().strip() if error_file.exists() else "(see its output above)"
    secondary = ("PeerFailedError", "CommTimeoutError")
    primary = [rank for rank in failed if not any(name in messages[rank] for name in secondary)]
    rank = (primary or sorted(failed))[0]
    return rank, messages[rank]


def launch_local(nproc: int, argv: Sequence[str], out: str, report: Callable[[str], None]) -> int:
    """Run ``nproc`` workers of this command on Gloo through torch's elastic launcher.

    What torchrun runs, with ``--standalone``. The launcher sets torchrun's environment for each worker, stops the
    others when one fails, and forwards SIGTERM, SIGINT and SIGHUP to the workers and waits for them (a scheduler's
    ``kill`` leaves nothing running).

    Args:
        nproc: the number of worker processes.
        argv: the command line of each worker (without ``--nproc``).
        out: the run directory, shared by the workers.
        report: where the launcher's own messages go (the command line writes them to stderr).

    Returns:
        0, or 1 with the failed worker to blame and its error printed.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in [name for name in os.environ if name.startswith(("PMI_", "OMPI_", "SLURM_"))]:
        del os.environ[name]  # the workers inherit this process's environment: no other launcher's variables
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"gossip-train-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # a free port, as torchrun --standalone
        max_restarts=0,
        monitor_interval=0.1,
        local_addr="127.0.0.1",
    )
    with tempfile.TemporaryDirectory(prefix="gossip-train-") as errors:
        os.environ[ERROR_DIR_VARIABLE] = errors
        try:
            elastic_launch(config, sys.executable)("-m", "gossip", *worker_argv(argv, out))
            return 0
        except ChildFailedError as failure:
            failed = {rank: process.exitcode for rank, process in failure.failures.items()}
        except SignalException as stopped:
            report(f"gossip-train: {stopped.sigval.name} received; workers stopped")
            return 128 + int(stopped.sigval)
        rank, message = root_cause(failed, Path(errors))
        others = f" ({len(failed) - 1} other worker(s) failed too)" if len(failed) > 1 else ""
        how = exit_description(failed[rank])
        report(f"gossip-train: worker rank {rank} of {nproc} {how}: {message}{others}")
        return 1
