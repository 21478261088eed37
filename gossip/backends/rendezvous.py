"""The rendezvous of a torch.distributed job started without torchrun's agent: a store, checked before use.

``init_process_group(init_method="tcp://host:port")`` leaves three launch errors to raw store errors or hangs:

* **The port is taken by another program.** Rank 0 cannot listen and fails at once, but the other ranks connect to
  the stranger and wait for a handshake that never comes, past the timeout.
* **Two processes with the same RANK**, or one rank never started: ``DistStoreError`` / ``connectFullMesh failed``.
* **WORLD_SIZE differs between processes**: a rank waits for ranks that do not exist, or too few join.

So the store is created here: rank 0 listens (a clear error if it cannot), every other rank connects within the
timeout (a clear error naming the address if it cannot), then each rank registers its rank and world size under
``gossip/`` keys and waits for every rank; a rank registered twice, a rank missing at the timeout, or a world size
that differs is a :class:`LaunchError` on every rank, naming the rank(s). The process group is then built on this
store (``init_process_group(store=...)``). Under torchrun the agent serves the store and assigns the ranks, so
none of this applies (:func:`agent_serves_the_store`).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from urllib.parse import urlparse

import torch.distributed as dist

from gossip.backends.launch_env import LaunchInfo
from gossip.errors import LaunchError

_KEY = "gossip/backends/rendezvous"


def agent_serves_the_store() -> bool:
    """True under torchrun (torch's elastic agent), whose own store on MASTER_PORT the workers join.

    Returns:
        Whether the workers join the agent's store instead of serving one.
    """
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _listening(host: str, port: int, deadline: float) -> bool:
    """Whether something accepts TCP connections at ``host:port`` before ``deadline`` (``time.monotonic()``).

    A connection that closes at once leaves rank 0's store undisturbed."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.01, min(1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)


def _connect(host: str, port: int, info: LaunchInfo, timeout: float) -> dist.TCPStore:
    """A client of rank 0's store, or a LaunchError when none answers within ``timeout``.

    The store's constructor is only called once the port accepts connections: waiting inside it for a rank 0 that
    never listens would leave a thread in it after this rank gives up, and a constructor that returns into an
    interpreter already shutting down aborts the process ("terminate called without an active exception"). It
    still runs in a daemon thread, because with a stranger on the port it waits for a handshake without bound; that
    thread stays blocked, and the process exits around it.
    """
    deadline = time.monotonic() + timeout
    result: list = []

    def connect() -> None:
        remaining = datetime.timedelta(seconds=max(0.1, deadline - time.monotonic()))
        try:
            result.append(dist.TCPStore(host, port, None, False, remaining, wait_for_workers=False))
        except Exception as error:  # reported below, in the caller's thread
            result.append(error)

    if _listening(host, port, deadline):
        thread = threading.Thread(target=connect, name=f"gossip-rendezvous-rank{info.rank}", daemon=True)
        thread.start()
        thread.join(max(1.0, deadline - time.monotonic()))  # a listening store answers in milliseconds
    if not result or isinstance(result[0], Exception):
        cause = f": {str(result[0]).splitlines()[0]}" if result else ""
        raise LaunchError(
            f"rank {info.rank}: no rendezvous with rank 0 at {host}:{port} within {timeout:g} s{cause}. Rank 0 "
            "did not start its store there (see its output), or another program holds that port: choose a free "
            "MASTER_PORT"
        )
    store = result[0]
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def _listen(host: str, port: int, info: LaunchInfo, timeout: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as error:
        raise LaunchError(
            f"rank 0: cannot serve the rendezvous at {host}:{port} ({str(error).splitlines()[0]}); another program "
            "probably holds that port: choose a free MASTER_PORT"
        ) from error


_POLL_SECONDS = 0.1
_LINGER_SECONDS = 2.0  # how long rank 0 keeps serving after an error, for the others to read it


def _count(store: dist.Store, rank: int) -> int:
    return int(store.add(f"{_KEY}/rank{rank}", 0))


def _fail(store: dist.Store, me: int, size: int, message: str) -> LaunchError:
    """Publish ``message`` for the ranks still waiting (first error wins) and return it as the error to raise.
    Rank 0 serves the store, so it lingers until the others have read the error (or _LINGER_SECONDS)."""
    if not store.check([f"{_KEY}/error"]):
        store.set(f"{_KEY}/error", message)
    if me == 0:
        joined = sum(_count(store, rank) for rank in range(size))
        deadline = time.monotonic() + _LINGER_SECONDS
        while int(store.add(f"{_KEY}/seen", 0)) < joined - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
    return LaunchError(message)


def _stale_hint(info: LaunchInfo) -> str:
    """For a process an MPI launcher started with torchrun's variables set as well: they may be stale."""
    if info.mpi_launcher is None:
        return ""
    return (
        f". This process was started by {info.mpi_launcher}, and torchrun's RANK={info.rank} WORLD_SIZE={info.size} "
        "are set too: if they were exported in the shell (the same on every rank, matching MPI only on this one), "
        "the other ranks stopped at once naming them: unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT before "
        "launching with mpiexec"
    )


def _check(store: dist.Store, info: LaunchInfo, where: str, timeout: float) -> None:
    me, size = info.rank, info.size
    if store.add(f"{_KEY}/rank{me}", 1) > 1:
        raise _fail(
            store,
            me,
            size,
            f"rank {me}: another process already joined the rendezvous at {where} as rank {me}: two processes "
            f"have RANK={me}; give each process its own RANK in [0, {size})",
        )
    store.set(f"{_KEY}/size{me}", str(size))
    keys = [f"{_KEY}/size{rank}" for rank in range(size)]
    deadline = time.monotonic() + timeout
    missing = list(range(size))
    while missing:
        if store.check([f"{_KEY}/error"]):
            if me != 0:
                store.add(f"{_KEY}/seen", 1)
            reported = store.get(f"{_KEY}/error").decode()
            raise _fail(store, me, size, f"rank {me}: the rendezvous at {where} failed: {reported}")
        missing = [rank for rank in missing if not store.check([keys[rank]])]
        if missing and time.monotonic() > deadline:
            twice = [rank for rank in range(size) if rank not in missing and _count(store, rank) > 1]
            duplicated = f"; rank(s) {twice} joined twice: two processes share a RANK" if twice else ""
            raise _fail(
                store,
                me,
                size,
                f"rank {me}: rank(s) {missing} of {size} did not join the rendezvous at {where} within "
                f"{timeout:g} s{duplicated}. Check that every rank was started with WORLD_SIZE={size} and its own "
                f"RANK, and the output of the missing ones{_stale_hint(info)}",
            )
        if missing:
            time.sleep(_POLL_SECONDS)
    other = {rank: int(store.get(keys[rank])) for rank in range(size)}
    other = {rank: value for rank, value in other.items() if value != size}
    if other:
        raise _fail(
            store,
            me,
            size,
            f"rank {me}: WORLD_SIZE differs between processes: this rank has {size}, but "
            + ", ".join(f"rank {rank} has {value}" for rank, value in sorted(other.items()))
            + "; start every process with the same WORLD_SIZE",
        )


def rendezvous_store(address: str, info: LaunchInfo, timeout: float) -> dist.Store:
    """The checked store of ``address`` (``tcp://host:port``) for ``info``'s rank and world size (see above).

    Args:
        address: ``tcp://host:port`` of the store.
        info: this process's launch information (rank and world size).
        timeout: seconds the rendezvous waits for every rank.

    Returns:
        The store, joined by every rank.

    Raises:
        LaunchError: the address cannot be parsed or served, or the ranks do not all arrive or disagree; the
            message names the rank and what to check.
    """
    parsed = urlparse(address)
    host, port = parsed.hostname or "127.0.0.1", int(parsed.port or 0)
    where = f"{host}:{port}"
    store = _listen(host, port, info, timeout) if info.rank == 0 else _connect(host, port, info, timeout)
    try:
        _check(store, info, where, timeout)
    except LaunchError:
        raise
    except RuntimeError as error:  # the store went away: rank 0, which serves it, ended
        raise LaunchError(
            f"rank {info.rank}: the rendezvous at {where} closed while this rank waited for the others "
            f"({str(error).splitlines()[0]}); rank 0, which serves it, failed or exited: see its output"
        ) from error
    return store
