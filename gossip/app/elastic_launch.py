"""``gossip-train --nproc N --elastic``: start N workers that survive each other's death.

torch's elastic agent (what ``--nproc`` uses otherwise) stops or restarts every worker when one fails; this
launcher does neither. It hosts the membership store (:func:`gossip.backends.membership.host_store`) in its own
process -- so any worker may die -- starts the workers as plain subprocesses, and reports a worker's unfinished
exit to the store the moment it sees it (:func:`~gossip.backends.membership.mark_dead`), which is what makes
failure detection take one membership interval. It forwards SIGTERM and SIGINT to the workers.

Workers ``--kill``ed at the same step die together: each waits at the top of the step until all of them are
there (:func:`die_together`), so that the survivors see one change naming them all.

``--restart RANK@STEP`` (after ``--kill RANK@K``, ``K < STEP``): once the survivors agreed that worker RANK left
(an epoch's decision without it), the launcher starts it again with the same command and environment. The
restarted worker waits until the group reached step STEP, then asks to join through
:meth:`gossip.wrapper.elastic_run.ElasticRun.join`. The members, at the top of STEP, record it in the store (key
``restart/reached/<STEP>``: once per restart, no per-step store traffic) and wait for the worker to be ready (key
``restart/ready/<RANK>``), so that its join lands at STEP or the next step boundary whatever its start-up time;
that wait ends early when a membership change is under way or the restarted process failed, and after
``--timeout`` seconds at most. When every worker still running is a restarted one still waiting for its step, the
group cannot reach it any more: the launcher sets ``restart/cancelled`` and they end with a
:class:`~gossip.errors.MembershipError`.

**Several nodes** (``gossip-train --nproc 4 --elastic --nnodes 2 --node-rank K``, one launcher per node, e.g.
under ``srun --ntasks-per-node 1``, with ``MASTER_ADDR`` and ``MASTER_PORT`` naming node 0): node 0's launcher hosts
the store on ``MASTER_PORT``; every launcher starts its ``nproc`` workers (global ranks ``K * nproc`` onwards) and
reports their exits to it. A whole node lost (its launcher and workers) is found by the members' heartbeats: its
workers are declared dead after the membership's ``detect`` seconds of silence. Node 0's launcher keeps the store
until the other launchers are done, or until the other nodes' workers have been silent that long. The store's node
is the one a job cannot lose (as today's single launcher).

Exit status: 0 when every worker ended with status 0 except those ``--kill`` told to kill themselves (and at least
one finished), and every ``--restart`` took place; else 1, naming each worker that failed otherwise.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from torch.distributed import TCPStore

from gossip.app.local_launch import exit_description
from gossip.backends.membership import DETECT_SECONDS, STORE_VARIABLE, host_store, mark_dead
from gossip.errors import ConfigError, MembershipError

logger = logging.getLogger("gossip")

#: Seconds between two looks at the workers.
POLL = 0.05
#: The store key the members set when they reach a restart's step (formatted with the step).
REACHED = "restart/reached/{step}"
#: The store counter of the workers at the top of a kill step (formatted with the step).
KILLED = "kill/arrived/{step}"
#: The store key a restarted worker sets when it saw its step reached and asks to join (formatted with its uid).
READY = "restart/ready/{uid}"
#: The store key the launcher sets when a restarted worker's process failed (formatted with its uid).
FAILED = "restart/failed/{uid}"
#: The store key the launcher sets when a restarted worker's step can no longer be reached.
CANCELLED = "restart/cancelled"
#: The store counter of the launchers of nodes other than node 0 whose workers all ended.
NODES_DONE = "launchers/done"


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


def check_restarts(kills: dict[int, int], restarts: dict[int, int], nproc: int | None, steps: int) -> None:
    """Validate ``--restart``: a restarted worker was killed before; its step is after its kill, before the end.

    Args:
        kills: worker -> the step of its ``--kill``.
        restarts: worker -> the step of its ``--restart``.
        nproc: the number of workers (None: not known here).
        steps: the run's steps.

    Raises:
        ConfigError: a restart of a worker that is not killed, at or before its kill's step, at or after the last step,
            or of a worker that does not exist; or a kill of a worker that does not exist.
    """
    for option, table in (("--kill", kills), ("--restart", restarts)):
        for rank, step in table.items():
            if nproc is not None and rank >= nproc:
                raise ConfigError(option, f"worker {rank}@{step} does not exist: --nproc {nproc} has workers "
                                  f"0-{nproc - 1}")  # fmt: skip
    for rank, step in restarts.items():
        if rank not in kills:
            raise ConfigError("--restart", f"worker {rank} is restarted at step {step} but never killed: add "
                              f"--kill {rank}@K")  # fmt: skip
        if step <= kills[rank]:
            raise ConfigError("--restart", f"worker {rank} is restarted at step {step}, not after its --kill at step "
                              f"{kills[rank]}")  # fmt: skip
        if step >= steps:
            raise ConfigError("--restart", f"worker {rank} is restarted at step {step}, not before the last step "
                              f"(--steps {steps})")  # fmt: skip


def wait_for_step(store: TCPStore, uid: int, step: int, interval: float = POLL) -> None:
    """In a restarted worker: wait until the group reached ``step`` (:data:`REACHED`), then say it is ready to join.

    Args:
        store: a client of the membership store.
        uid: this worker.
        step: the step of its ``--restart``.
        interval: seconds between two looks at the store.

    Raises:
        MembershipError: the launcher cancelled the restart (no member is left to reach the step).
    """
    key = REACHED.format(step=step)
    while not store.check([key]):
        if store.check([CANCELLED]):
            raise MembershipError(
                f"member {uid}: restarted to join at step {step}, but every other worker ended before the group "
                "reached it; nothing to join"
            )
        time.sleep(interval)
    store.set(READY.format(uid=uid), str(step))


def hold_for_joiners(
    store: TCPStore, uid: int, step: int, joiners: Sequence[int], changing: threading.Event, timeout: float
) -> list[int]:
    """In a member at the top of ``step``: record that the group reached it, and wait for its restarted workers.

    The wait ends when each of ``joiners`` said it is ready to join (:data:`READY`) or its restarted process failed
    (:data:`FAILED`), when a membership change is under way (a join already asked for, or a departure to agree on
    first), or after ``timeout`` seconds: the join then lands at a later step, never a hang.

    Args:
        store: a client of the membership store.
        uid: this member.
        step: the step.
        joiners: the workers restarted at this step.
        changing: set while a membership change is under way (:attr:`Membership.changed`).
        timeout: the most seconds to wait.

    Returns:
        The joiners not ready when the wait ended.
    """
    store.set(REACHED.format(step=step), str(uid))
    deadline = time.monotonic() + timeout
    waiting = list(joiners)
    while waiting and not changing.is_set() and time.monotonic() < deadline:
        waiting = [
            j for j in waiting if not store.check([READY.format(uid=j)]) and not store.check([FAILED.format(uid=j)])
        ]
        if waiting:
            time.sleep(POLL)
    return waiting


def die_together(store: TCPStore, step: int, count: int, timeout: float) -> None:
    """In a worker ``--kill``ed at ``step`` with others: wait until all ``count`` of them are at its top.

    Several workers killed at the same step then die within moments of each other, as the workers of one lost node
    would, and the survivors see one change naming them all (otherwise a later one dies during the re-formation and
    the next epoch drops it: docs/failures.md). The wait is bounded by ``timeout`` seconds: a co-killed worker that
    died before reaching the step is not waited for longer.

    Args:
        store: a client of the membership store.
        step: the kill step.
        count: how many workers are killed at it.
        timeout: the most seconds to wait.
    """
    key, deadline = KILLED.format(step=step), time.monotonic() + timeout
    arrived = store.add(key, 1)
    while arrived < count and time.monotonic() < deadline:
        time.sleep(POLL / 5)
        arrived = store.add(key, 0)


def _departed(store: TCPStore, uid: int) -> bool:
    """Whether the latest decided epoch leaves ``uid`` out (the survivors agreed that it left)."""
    epoch = int(store.get("epoch"))
    while epoch > 0 and not store.check([f"e{epoch}/decision"]):
        epoch -= 1
    return uid not in json.loads(store.get(f"e{epoch}/decision"))["members"]


def node_store(nodes: int, node_rank: int, size: int, master: tuple[str, int] | None, timeout: float) -> TCPStore:
    """The membership store as this node's launcher sees it: hosted here on node 0, a client of it elsewhere.

    Args:
        nodes: the number of nodes.
        node_rank: this node, in ``[0, nodes)``.
        size: the workers of the job.
        master: node 0's address and the store's port (None on one node: a free port on this host).
        timeout: seconds a store operation (and the connection to node 0) may wait.

    Returns:
        The store.

    Raises:
        MembershipError: node 0's store cannot be reached within ``timeout``.
    """
    if node_rank == 0:
        return host_store(size, port=master[1] if master else 0)
    host, port = master
    try:
        return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except Exception as error:  # c10d raises DistNetworkError / RuntimeError
        raise MembershipError(
            f"node {node_rank}: cannot reach the membership store at {host}:{port} (node 0's launcher) within "
            f"{timeout:.0f} s: {error}; start node 0 too, with the same MASTER_ADDR and MASTER_PORT"
        ) from error


def wait_for_other_nodes(store: TCPStore, nodes: int, local: Sequence[int], size: int, silence: float) -> None:
    """On node 0, after its workers ended: keep the store until the other nodes are done or silent.

    Args:
        store: the hosted store.
        nodes: the number of nodes.
        local: node 0's workers.
        size: the workers of the job.
        silence: seconds after which the other nodes' workers count as gone when no heartbeat of theirs changed.
    """
    remote = [f"hb/{uid}" for uid in range(size) if uid not in local]
    seen, since = None, time.monotonic()
    while int(store.add(NODES_DONE, 0)) < nodes - 1:
        beats = store.multi_get(remote)
        if beats != seen:
            seen, since = beats, time.monotonic()
        elif time.monotonic() - since >= silence:
            return
        time.sleep(POLL)


def launch_elastic(
    nproc: int,
    command: Sequence[str],
    kills: dict[int, int],
    say: Callable[[str], None] = logger.warning,
    restarts: dict[int, int] | None = None,
    *,
    nodes: int = 1,
    node_rank: int = 0,
    master: tuple[str, int] | None = None,
    timeout: float = 300.0,
) -> int:
    """Run ``nproc`` elastic workers of ``command`` and wait for all of them (and for the restarted ones).

    Args:
        nproc: the number of workers (on this node).
        command: each worker's command line (e.g. ``python -m gossip ...`` without ``--nproc``).
        kills: worker -> the step at which it kills itself (``--kill``), to tell those deaths from failures.
        say: where the launcher's messages go (the store's address, each exit); ``gossip-train`` prints them on
            stderr.
        restarts: worker -> the step from which it trains again (``--restart``; see the module docstring).
        nodes: the number of nodes, one launcher each.
        node_rank: this node, in ``[0, nodes)``.
        master: node 0's address and the store's port (needed with several nodes).
        timeout: seconds a launcher waits for node 0's store.

    Returns:
        The exit status (see the module docstring).

    Raises:
        ConfigError: several nodes without ``master``, or with ``--restart``.
        MembershipError: node 0's store cannot be reached.
    """
    restarts = dict(restarts or {})
    if nodes > 1 and master is None:
        raise ConfigError("--nnodes", "several nodes need MASTER_ADDR and MASTER_PORT (node 0's address, a free port)")
    if nodes > 1 and restarts:
        raise ConfigError("--restart", "--restart runs on one node")
    size, local = nproc * nodes, range(node_rank * nproc, (node_rank + 1) * nproc)
    store = node_store(nodes, node_rank, size, master, timeout)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    env[STORE_VARIABLE] = f"{master[0] if master else '127.0.0.1'}:{store.port}"
    say(f"gossip-train: membership store at {env[STORE_VARIABLE]} (a worker restarted with the same command and "
        f"RANK, and {STORE_VARIABLE} set to it, joins the run)")  # fmt: skip

    def start(rank: int) -> subprocess.Popen:
        place = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": rank - local[0], "LOCAL_WORLD_SIZE": nproc}
        worker_env = {**env, **{k: str(v) for k, v in place.items()}, "MASTER_ADDR": env[STORE_VARIABLE].split(":")[0],
                      "MASTER_PORT": str(store.port)}  # fmt: skip
        return subprocess.Popen(list(command), env=worker_env)

    # (rank, process, restarted): a restarted worker is a second process of its rank
    workers = [(rank, start(rank), False) for rank in local]

    def forward(signum: int, _frame: object) -> None:
        for _, process, _ in workers:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    codes: dict[int, int] = {}  # index in workers -> exit status
    due: dict[int, int] = {}  # killed workers to restart -> the restart's step
    never: list[int] = []  # workers whose restart could not take place
    try:
        while len(codes) < len(workers) or due:
            for index, (rank, process, restarted) in enumerate(list(workers)):
                code = process.poll()
                if index not in codes and code is not None:
                    codes[index] = code
                    if code != 0:
                        if restarted:
                            store.set(FAILED.format(uid=rank), exit_description(code))  # members no longer wait for it
                        mark_dead(store, rank, exit_description(code))
                        say(f"gossip-train: worker {rank} {exit_description(code)}")
                        if rank in restarts and not restarted:
                            due[rank] = restarts[rank]
            for rank, step in list(due.items()):
                if _departed(store, rank):  # the survivors agreed that it left: it may ask to join
                    say(f"gossip-train: restarting worker {rank}; it joins at step {step}")
                    workers.append((rank, start(rank), True))
                    del due[rank]
            running = [(rank, restarted) for index, (rank, _, restarted) in enumerate(workers) if index not in codes]
            if not any(not restarted for _, restarted in running) and (running or due):
                waiting = [rank for rank, _ in running if not store.check([REACHED.format(step=restarts[rank])])]
                if len(waiting) == len(running):  # nobody left to reach their steps
                    store.set(CANCELLED, "1")
                    never += list(due)
                    due.clear()
            time.sleep(POLL)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if node_rank > 0:
        store.add(NODES_DONE, 1)
    elif nodes > 1:
        wait_for_other_nodes(store, nodes, local, size, DETECT_SECONDS)
    failed = {}
    for index, code in sorted(codes.items()):
        rank, _, restarted = workers[index]
        if code != 0 and not (not restarted and rank in kills and code == -signal.SIGKILL):
            failed[rank] = code
    for rank in never:
        say(f"gossip-train: worker {rank} not restarted: every other worker ended before its departure was agreed")
    if failed or never or all(c != 0 for c in codes.values()):
        for rank, code in sorted(failed.items()):
            say(f"gossip-train: worker {rank} of {nproc} {exit_description(code)}")
        return 1
    return 0
