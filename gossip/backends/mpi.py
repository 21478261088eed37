"""MPI communicator on mpi4py.

An MPI request advances only inside MPI calls, so every MPI call of this communicator is made by its
:class:`CommThread`, which polls its requests with ``Test`` and short sleeps: transfers progress while the
training thread computes, and a rank waiting for a slow peer does not spin a whole core (a blocking
``Wait`` busy-polls in MPICH). Tensors travel as bytes (``MPI.BYTE``), so every torch dtype -- bfloat16 too --
moves bit for bit; contiguous CPU tensors are passed without a copy. Reductions of float16/bfloat16 run in float32
(MPI has no portable 16-bit float sum).

GPU tensors (``device="cuda"``). When the MPI library is CUDA-aware (:func:`cuda_aware`: Open MPI's and MPICH's
``MPIX_Query_cuda_support``, or MPICH's ``MPIX_GPU_query_support``; ``GOSSIP_MPI_CUDA_AWARE=1``/``0`` overrides
the answer) device buffers go to MPI directly. Otherwise every tensor is staged through a pinned host buffer (copied
there before a send, copied back after a receive completes, on the communicator's thread), and one log line says
so. ``stage=True`` forces staging, also for CPU tensors (how the tests cover that path without a GPU).

A dead peer. MPI offers no failure detection: a receive from a killed process simply never completes, and a
waiting rank raises :class:`CommTimeoutError` naming that peer after ``timeout``. Under MPICH's Hydra started
with ``mpiexec -disable-auto-cleanup`` (without it Hydra kills the whole job when one process dies), Hydra
sends SIGUSR1 to every surviving process when one dies (pmodels/mpich#1598), whose default action would kill
them silently. This communicator handles SIGUSR1 (when it is installed from the main thread and no one else
handles it): a wait in progress or started later then raises :class:`PeerFailedError` at once, naming the peers
it still waits for. An uncaught error after a failure ends the process with status 1 without ``MPI_Finalize``,
which would wait for the dead process forever (:mod:`gossip.backends.exit_guard`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gossip.backends.base import Communicator
from gossip.backends.comm_thread import CommThread, Handle, Progress
from gossip.backends.exit_guard import watch
from gossip.backends.launch_env import LaunchInfo
from gossip.backends.wire import HEADER_LEN, HEADER_TAG, PAYLOAD_TAG, Transfer, check_header, exchange_name
from gossip.errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    CommTimeoutError,
    GossipError,
    LaunchError,
    PeerFailedError,
)

_BARRIER_TAG = 9
_POLL_SLEEP_MAX = 1e-3
_REPORT_GRACE_SECONDS = 0.5  # seconds between Test() calls once a wait has lasted a while
_Pending = tuple[Any, str, "Callable[[], None] | None"]  # (request, part it completes, continuation)


_launcher_reported_failure = threading.Event()
_report_lock = threading.RLock()  # the SIGUSR1 handler (main thread) and the wakeup-fd watcher report once
_live: weakref.WeakSet[MPICommunicator] = weakref.WeakSet()  # this process's open communicators
_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi_proto.h
logger = logging.getLogger(__name__)


def cuda_aware() -> bool:
    """Whether the loaded MPI library accepts CUDA device buffers (call after MPI is initialised).

    Returns:
        True when the library reports CUDA support.
    """
    forced = os.environ.get("GOSSIP_MPI_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line})
    except OSError:
        return False
    for path in paths:
        library = ctypes.CDLL(path)
        if hasattr(library, "MPIX_Query_cuda_support"):
            return bool(library.MPIX_Query_cuda_support())
        if hasattr(library, "MPIX_GPU_query_support"):
            supported = ctypes.c_int(0)
            query = library.MPIX_GPU_query_support
            query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            return query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(supported)) == 0 and bool(supported.value)
    return False


def _on_process_failure(signum: int, frame: Any) -> None:
    """SIGUSR1 from Hydra: some process of this job died (mpiexec -disable-auto-cleanup).

    Besides setting the flag every wait polls, each live communicator of this process says at once, on stderr,
    what the launcher reported and what it was doing: Hydra SIGKILLs the remaining processes as soon as the first
    survivor exits, which can be before this rank's own :class:`PeerFailedError` is printed.
    """
    with _report_lock:  # reentrant: the main thread's handler may interrupt itself
        if _launcher_reported_failure.is_set():
            return
        _launcher_reported_failure.set()
        for comm in list(_live):
            if not comm.closed:
                with contextlib.suppress(OSError):
                    os.write(2, f"{comm.launcher_report()}\n".encode())


def _watch_wakeup_fd(read_end: int) -> None:
    """A thread's loop: report SIGUSR1 as soon as its C-level handler writes the signal number to the wakeup fd.

    Python runs a signal's handler in the main thread at its next bytecode, which can come late (a long C call)
    or never (Hydra's SIGKILL first); the wakeup fd is written by the C handler itself, in whichever thread the
    signal interrupts, so this thread reports at once.
    """
    while True:
        try:
            numbers = os.read(read_end, 64)
        except OSError:
            return
        if not numbers:
            return
        if signal.SIGUSR1 in numbers:
            _on_process_failure(signal.SIGUSR1, None)


def _handle_launcher_failure_signal() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:  # None would be a handler installed outside Python
        return
    signal.signal(signal.SIGUSR1, _on_process_failure)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # someone else (an asyncio loop) owns the wakeup fd: keep theirs, report from the handler
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return
    threading.Thread(target=_watch_wakeup_fd, args=(read_end,), name="gossip-mpi-sigusr1", daemon=True).start()


def _bytes(tensor: torch.Tensor) -> Any:
    """A zero-copy byte view mpi4py accepts (numpy for CPU tensors, the tensor itself for CUDA)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


class MPICommunicator(Communicator):
    """A communicator on a duplicate of ``MPI.COMM_WORLD``.

    Args:
        info: this process's launch information; must come from an MPI launcher.
        timeout: seconds that bound every wait.
        device: where the tensors it moves live, ``"cpu"`` or ``"cuda"`` (this rank's GPU by local rank).
        stage: copy every tensor through a pinned host buffer; None stages CUDA tensors only when the MPI library
            is not CUDA-aware, True forces staging (also for CPU tensors).
        world: the mpi4py communicator whose ranks this one spans (duplicated); None is ``COMM_WORLD``. A lane of
            sharded replicas passes its ``COMM_WORLD.Split`` (:func:`gossip.backends.lanes.init_lanes`).

    Raises:
        LaunchError: this process was not started by an MPI launcher consistent with ``info``.
        BackendUnavailableError: ``device`` is neither cpu nor cuda, or cuda without a visible GPU.
    """

    backend = "mpi"

    def __init__(
        self,
        info: LaunchInfo,
        timeout: float,
        device: str | torch.device = "cpu",
        stage: bool | None = None,
        world: Any = None,
    ):
        super().__init__()
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = (MPI.COMM_WORLD if world is None else world).Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        if (self.rank, self.size) != (info.rank, info.size):
            raise LaunchError(
                f"MPI reports rank {self.rank} of {self.size} but the {info.launcher} environment says rank "
                f"{info.rank} of {info.size}: launch with mpiexec/mpirun (or srun --mpi=pmix) so MPI sees all ranks"
            )
        self.local_rank, self.local_size = info.local_rank, info.local_size
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise BackendUnavailableError(
                    f"rank {self.rank}: MPI with device={device!r} needs a visible CUDA device"
                )
            if self.device.index is None:
                self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        elif self.device.type != "cpu":
            raise BackendUnavailableError(f"rank {self.rank}: MPI moves cpu or cuda tensors, not {self.device.type}")
        self.cuda_aware = self.device.type == "cuda" and cuda_aware()
        self.staged = (self.device.type == "cuda" and not self.cuda_aware) if stage is None else bool(stage)
        if self.staged:
            reason = "forced (stage=True)" if stage else "this MPI library is not CUDA-aware"
            logger.warning(
                "rank %d: MPI: %s tensors are staged through %s host buffers: %s",
                self.rank,
                self.device.type,
                "pinned" if torch.cuda.is_available() else "plain",
                reason,
            )
        self.timeout = timeout
        self._thread = CommThread(f"gossip-mpi-rank{self.rank}", self.rank, timeout)
        self._closed = False
        _handle_launcher_failure_signal()
        _live.add(self)
        watch(self)

    @property
    def exit_delay(self) -> float:
        """Seconds the exit guard waits before ending the process after an uncaught error.

        Once the launcher has reported a dead process, a moment for the other survivors to print their own report
        before Hydra, which SIGKILLs them when this process exits, ends them (:mod:`gossip.backends.exit_guard`).
        """
        return _REPORT_GRACE_SECONDS if _launcher_reported_failure.is_set() else 0.0

    def launcher_report(self) -> str:
        """What this rank says when the launcher reports a dead process.

        Returns:
            The operation it was in and what it still waited for (the dead peer, when this rank was exchanging
                with it), or that it was computing.
        """
        running = self._thread.running
        doing = (
            f"during {running.operation}, waiting to {running.describe()}"
            if running is not None
            else "between communications (its next one raises PeerFailedError)"
        )
        return f"gossip: rank {self.rank}: the MPI launcher reported that a process of this job died (SIGUSR1) {doing}"

    @property
    def failure(self) -> BaseException | None:
        """The first error of this communicator (None while healthy); after it every operation is refused."""
        return self._thread.failure

    # -- staging ------------------------------------------------------------------------------------------------
    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like ``tensor`` (pinned where CUDA exists, so the copies run at full speed)."""
        return torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=torch.cuda.is_available())

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        """What MPI reads for a send of ``tensor``: itself, or its copy in a host buffer when staging."""
        if not self.staged:
            return tensor
        host = self._host(tensor)
        host.copy_(tensor.reshape(-1))  # from the GPU: waits for the kernels that produce ``tensor``
        return host

    def _incoming(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """Where MPI writes a receive into ``tensor``, and what completes it (the copy back when staging)."""
        if not self.staged:
            return tensor, lambda: None
        host = self._host(tensor)
        return host, lambda: tensor.reshape(-1).copy_(host)

    def _cancel(self, pending: list[_Pending]) -> None:
        """Cancel the point-to-point requests; a nonblocking collective cannot be cancelled (MPI 4.0, section 5.12)
        and MPICH refuses it ("Attempt to cancel an unknown type of request"), which must not hide the error that
        made this rank give up."""
        for request, _, _ in pending:
            with contextlib.suppress(self._MPI.Exception):
                request.Cancel()

    def _poll(self, progress: Progress, pending: list[_Pending]) -> None:
        """Drive ``pending`` requests to completion; a continuation may append more requests to ``pending``."""
        deadline = time.monotonic() + self.timeout
        sleep = 0.0
        while pending:
            finished = [entry for entry in pending if entry[0].Test()]
            for entry in finished:
                pending.remove(entry)
                _, part, then = entry
                if then is not None:
                    then()
                else:
                    progress.finish(part)
            if finished:
                sleep = 0.0
                continue
            if self._thread.failure is not None:  # a waiter gave up (its own timeout); stop polling
                self._cancel(pending)
                raise self._thread.failure
            if _launcher_reported_failure.is_set():
                self._cancel(pending)
                raise PeerFailedError(
                    f"rank {self.rank}: {progress.operation}: the MPI launcher reported that a process of this job "
                    f"died (SIGUSR1); gave up waiting to {progress.describe()}"
                )
            if time.monotonic() > deadline:
                self._cancel(pending)
                raise CommTimeoutError(
                    f"rank {self.rank}: {progress.operation} timed out after {self.timeout:.1f} s waiting to "
                    f"{progress.describe()}"
                )
            time.sleep(sleep)
            sleep = min(_POLL_SLEEP_MAX, sleep * 2 + 1e-5)

    # -- point to point -------------------------------------------------------------------------------------
    def _start_exchange(self, sends: list[Transfer], recvs: list[Transfer], seq: int) -> Handle:
        comm = self._comm

        def run(progress: Progress) -> None:
            pending: list[_Pending] = []
            keep_alive = []
            for transfer in sends:
                part = transfer.describe("send to")
                progress.add(part)
                header = np.asarray(transfer.header(seq), dtype=np.int64)
                keep_alive.append(header)
                if transfer.tensor.numel():
                    payload = self._outgoing(transfer.tensor)
                    keep_alive.append(payload)
                    pending.append((comm.Isend(header, transfer.peer, HEADER_TAG), f"header of {part}", None))
                    pending.append((comm.Isend(_bytes(payload), transfer.peer, PAYLOAD_TAG), part, None))
                else:
                    pending.append((comm.Isend(header, transfer.peer, HEADER_TAG), part, None))
            for transfer in recvs:
                part = transfer.describe("receive from")
                progress.add(part)
                header = np.empty(HEADER_LEN, dtype=np.int64)
                keep_alive.append(header)

                def on_header(transfer: Transfer = transfer, header: np.ndarray = header, part: str = part) -> None:
                    check_header(header.tolist(), transfer, seq, self.rank)
                    if transfer.tensor.numel():
                        buffer, complete = self._incoming(transfer.tensor)

                        def arrived(complete: Callable[[], None] = complete, part: str = part) -> None:
                            complete()
                            progress.finish(part)

                        keep_alive.append(buffer)
                        pending.append((comm.Irecv(_bytes(buffer), transfer.peer, PAYLOAD_TAG), part, arrived))
                    else:
                        progress.finish(part)

                pending.append((comm.Irecv(header, transfer.peer, HEADER_TAG), part, on_header))
            self._poll(progress, pending)

        peers = sorted({t.peer for t in sends} | {t.peer for t in recvs})
        return self._thread.submit(f"{exchange_name(seq)} with peer(s) {peers}", run)

    # -- collectives ----------------------------------------------------------------------------------------
    def _await(self, progress: Progress, request: Any, part: str) -> None:
        progress.add(part)
        self._poll(progress, [(request, part, None)])

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        if tensor.dtype == torch.bool:
            raise ArgumentTypeError(f"rank {self.rank}: all_reduce of a bool tensor is not supported")
        narrow = tensor.dtype in (torch.float16, torch.bfloat16)

        def run(progress: Progress) -> None:
            # the sum runs on the host (MPI reduces with CPU code unless CUDA-aware; numpy needs host memory)
            in_place = tensor.device.type == "cpu" and not narrow
            host = tensor if in_place else tensor.to("cpu", torch.float32 if narrow else tensor.dtype)
            request = self._comm.Iallreduce(self._MPI.IN_PLACE, host.reshape(-1).numpy())
            self._await(progress, request, "every rank")
            if op == "avg":
                host.div_(self.size)
            if not in_place:
                tensor.copy_(host)

        return self._thread.submit(f"all_reduce({op}) of {tensor.dtype}{list(tensor.shape)}", run)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        def run(progress: Progress) -> None:
            buffer, complete = self._incoming(tensor)
            if self.staged and self.rank == src:
                buffer.copy_(tensor.reshape(-1))
            self._await(progress, self._comm.Ibcast(_bytes(buffer), root=src), f"rank {src}")
            complete()

        return self._thread.submit(f"broadcast from rank {src}", run)

    def barrier(self, timeout: float | None = None) -> None:
        """A monitored barrier: rank 0 collects a token from every rank, so a timeout names who is missing.

        Args:
            timeout: seconds to wait at most; None waits the communicator's timeout.
        """

        def run(progress: Progress) -> None:
            token = np.zeros(1, dtype=np.int8)
            if self.rank == 0:
                arrivals: list[_Pending] = []
                for peer in range(1, self.size):
                    part = f"rank {peer} to arrive at the barrier"
                    progress.add(part)
                    arrivals.append((self._comm.Irecv(np.zeros(1, dtype=np.int8), peer, _BARRIER_TAG), part, None))
                self._poll(progress, arrivals)
                releases = [
                    (self._comm.Isend(token, p, _BARRIER_TAG), f"release rank {p}", None) for p in range(1, self.size)
                ]
                self._poll(progress, releases)
            else:
                self._await(
                    progress,
                    self._comm.Isend(token, 0, _BARRIER_TAG),
                    "rank 0 to receive this rank's arrival",
                )
                self._await(progress, self._comm.Irecv(token, 0, _BARRIER_TAG), "rank 0 to release the barrier")

        self._thread.call("barrier", run, timeout)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (see :meth:`Communicator.all_gather_object`).

        Args:
            obj: a picklable object.

        Returns:
            One object per rank, index = rank.
        """

        def run(progress: Progress) -> list[Any]:
            data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
            sizes = np.zeros(self.size, dtype=np.int64)
            self._await(progress, self._comm.Iallgather(np.asarray([data.size], dtype=np.int64), sizes), "every rank")
            out = np.empty(int(sizes.sum()), dtype=np.uint8)
            self._await(progress, self._comm.Iallgatherv(data, [out, sizes.tolist()]), "every rank")
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            return [pickle.loads(out[offsets[r] : offsets[r + 1]].tobytes()) for r in range(self.size)]

        return self._thread.call("all_gather_object", run)

    def close(self) -> None:
        """Barrier (when healthy), stop the communication thread, then free the duplicate communicator.

        Safe to call twice; after a failure only the thread is stopped.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.failure is None:
                self.barrier()
        except GossipError:
            pass
        finally:
            self._thread.stop()
            if self._thread.failure is None:
                self._comm.Free()
