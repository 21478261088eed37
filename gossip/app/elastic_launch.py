"""``gossip-train --nproc N --elastic``: start N workers that survive each other's death.

torch's elastic agent (what ``--nproc`` uses otherwise) stops or restarts every worker when one fails; this
launcher does neither. It hosts the membership store (:func:`gossip.backends.membership.host_store`) in its own
process -- so any worker may die -- starts the workers as plain subprocesses, and reports a worker's unfinished
exit to the store the moment it sees it (:func:`~gossip.backends.membership.mark_dead`), which is what makes
failure detection take one membership interval. It forwards SIGTERM and SIGINT to the workers.

Exit status: 0 when every worker ended with status 0 except those ``--kill`` told to kill themselves (and at least
one finished); else 1, naming each worker that failed otherwise.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from gossip.backends.membership import STORE_VARIABLE, host_store, mark_dead
from gossip.errors import ConfigError

logger = logging.getLogger("gossip")

#: Seconds between two looks at the workers.
POLL = 0.05


def parse_kill(text: str) -> tuple[int, int]:
    """``RANK@STEP`` as two integers.

    Args:
        text: the option's value.

    Returns:
        (rank, step).

    Raises:
        ConfigError: not two non-negative integers joined by ``@``.
    """
    rank, _, step = text.partition("@")
    if not (rank.isdigit() and step.isdigit()):
        raise ConfigError("--kill", f"expected RANK@STEP (e.g. 2@40), got {text!r}")
    return int(rank), int(step)


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def launch_elastic(
    nproc: int, command: Sequence[str], kills: dict[int, int], say: Callable[[str], None] = logger.warning
) -> int:
    """Run ``nproc`` elastic workers of ``command`` and wait for all of them.

    Args:
        nproc: the number of workers.
        command: each worker's command line (e.g. ``python -m gossip ...`` without ``--nproc``).
        kills: worker -> the step at which it kills itself (``--kill``), to tell those deaths from failures.
        say: where the launcher's messages go (the store's address, each exit); ``gossip-train`` prints them on
            stderr.

    Returns:
        The exit status (see the module docstring).
    """
    store = host_store(nproc)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    env[STORE_VARIABLE] = f"127.0.0.1:{store.port}"
    say(f"gossip-train: membership store at {env[STORE_VARIABLE]} (a worker restarted with the same command and "
        f"RANK, and {STORE_VARIABLE} set to it, joins the run)")  # fmt: skip
    workers = {}
    for rank in range(nproc):
        place = {"RANK": rank, "WORLD_SIZE": nproc, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": nproc}
        worker_env = {**env, **{k: str(v) for k, v in place.items()}, "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(store.port)}  # fmt: skip
        workers[rank] = subprocess.Popen(list(command), env=worker_env)

    def forward(signum: int, _frame: object) -> None:
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    codes: dict[int, int] = {}
    try:
        while len(codes) < nproc:
            for rank, process in workers.items():
                code = process.poll()
                if rank not in codes and code is not None:
                    codes[rank] = code
                    if code != 0:
                        mark_dead(store, rank, _how(code))
                        say(f"gossip-train: worker {rank} {_how(code)}")
            time.sleep(POLL)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    failed = {r: c for r, c in codes.items() if c != 0 and not (r in kills and c == -signal.SIGKILL)}
    if failed or all(c != 0 for c in codes.values()):
        for rank, code in sorted(failed.items()):
            say(f"gossip-train: worker {rank} of {nproc} {_how(code)}")
        return 1
    return 0
