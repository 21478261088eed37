"""torch.distributed communicator: Gloo on CPU, NCCL on GPU, one code path.

Transfers run on a :class:`CommThread`. Gloo moves bytes on its own I/O threads, so the comm thread only posts
the operations and waits on them; receives are always posted together with sends (a blocking Gloo send is a
rendezvous: two peers that both send first deadlock). NCCL ignores tags but keeps per-pair order, which is all
the header/payload protocol needs. A peer that dies surfaces as Gloo's "connection closed" and is re-raised as
:class:`PeerFailedError` naming the peer; a peer that never answers as :class:`CommTimeoutError` naming it. An
uncaught error after such a failure ends the process with status 1 without running Gloo's teardown
(:mod:`gossip.backends.exit_guard`).
"""

from __future__ import annotations

import datetime
import gc
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

# Functions declared with ``group=dist.group.WORLD`` defaults capture the default process group itself when their
# module is first imported after init_process_group (torch.optim imports this one lazily, through torch._dynamo).
# That reference outlives destroy_process_group, and with it Gloo's worker and I/O threads, into interpreter
# teardown. Imported here, before any process group exists, the defaults are None.
import torch.distributed.nn.functional

from gossip.backends.base import (
    HEADER_LEN,
    HEADER_TAG,
    PAYLOAD_TAG,
    CommThread,
    Communicator,
    Handle,
    Progress,
    Transfer,
    check_header,
)
from gossip.backends.exit_guard import watch
from gossip.errors import CommTimeoutError, GossipError, PeerFailedError
from gossip.launch_env import LaunchInfo


class TorchDistCommunicator(Communicator):
    """A communicator on a torch.distributed process group (``backend`` is "gloo" or "nccl").

    By default it creates the default group (``init_process_group``) and destroys it in :meth:`close`. With
    ``adopt=group`` it runs on a group the caller already created -- the default group (``dist.group.WORLD``) or
    a subgroup from ``new_group`` -- whose ranks ``info`` gives; it then leaves the group alive at :meth:`close`
    and, on NCCL, uses the CUDA device the caller selected.
    """

    def __init__(
        self,
        backend: str,
        info: LaunchInfo,
        init_method: str | None,
        timeout: float,
        *,
        adopt: dist.ProcessGroup | None = None,
        **init: Any,
    ):
        super().__init__()
        self.backend = backend
        self.rank, self.size = info.rank, info.size
        self.local_rank, self.local_size = info.local_rank, info.local_size
        self.timeout = timeout
        self.owns_group = adopt is None
        self.group = None if adopt is None or adopt is dist.group.WORLD else adopt  # None: the default group
        if backend == "nccl":
            index = info.local_rank % torch.cuda.device_count() if adopt is None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if adopt is None:
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=info.rank,
                world_size=info.size,
                timeout=datetime.timedelta(seconds=timeout),
                **init,
            )
        self._thread = CommThread(f"gossip-{backend}-rank{self.rank}", self.rank, timeout)
        self._closed = False
        watch(self)

    @property
    def failure(self) -> BaseException | None:
        """The first error of this communicator (None while healthy); after it every operation is refused."""
        return self._thread.failure

    # -- helpers --------------------------------------------------------------------------------------------
    def _global(self, peer: int) -> int:
        """torch.distributed addresses peers by their rank in the default group."""
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def _wait(self, work: dist.Work, part: str, progress: Progress, peer: int | None) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            text = str(error)
            who = f"peer {peer}" if peer is not None else "a peer"
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CommTimeoutError(
                    f"rank {self.rank}: {progress.operation} timed out after {self.timeout:.1f} s waiting to "
                    f"{part} ({text.splitlines()[0]})"
                ) from error
            raise PeerFailedError(
                f"rank {self.rank}: {progress.operation}: {who} failed or closed its connection while this "
                f"rank waited to {part}: {text.splitlines()[0]}"
            ) from error
        progress.finish(part)

    # -- point to point -------------------------------------------------------------------------------------
    def _start_exchange(self, sends: list[Transfer], recvs: list[Transfer], seq: int) -> Handle:
        def run(progress: Progress) -> None:
            # 1. every header out and every header receive posted: no payload yet.
            posted: list[tuple[dist.Work, str, int]] = []
            for transfer in sends:
                part = transfer.describe("send to")
                progress.add(part)
                header = torch.tensor(transfer.header(seq), dtype=torch.int64, device=self.device)
                posted.append(
                    (dist.isend(header, self._global(transfer.peer), self.group, tag=HEADER_TAG), part, transfer.peer)
                )
            headers = []
            for transfer in recvs:
                part = transfer.describe("receive from")
                progress.add(part)
                buffer = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                headers.append(
                    (
                        transfer,
                        buffer,
                        dist.irecv(buffer, self._global(transfer.peer), self.group, tag=HEADER_TAG),
                        part,
                    )
                )
            # 2. each payload receive is posted once its header matched the buffer.
            for transfer, buffer, work, part in headers:
                self._wait(work, f"receive the header of {part}", progress, transfer.peer)
                check_header(buffer.tolist(), transfer, seq, self.rank)
                if transfer.tensor.numel():
                    posted.append(
                        (
                            dist.irecv(transfer.tensor, self._global(transfer.peer), self.group, tag=PAYLOAD_TAG),
                            part,
                            transfer.peer,
                        )
                    )
                else:
                    progress.finish(part)
            # 3. payload sends only now: this rank's "ready to receive" notices are already on the wire, so they
            #    cannot queue behind its own bulk data on the same connection (which serialised the two directions
            #    of a pair: 2 M/B instead of M/B on a rate-limited link).
            for transfer in sends:
                if transfer.tensor.numel():
                    posted.append(
                        (
                            dist.isend(transfer.tensor, self._global(transfer.peer), self.group, tag=PAYLOAD_TAG),
                            transfer.describe("send to"),
                            transfer.peer,
                        )
                    )
            for work, part, peer in posted:
                self._wait(work, part, progress, peer)
                progress.finish(part)

        peers = sorted({t.peer for t in sends} | {t.peer for t in recvs})
        return self._thread.submit(f"exchange {seq} with peer(s) {peers}", run)

    # -- collectives ----------------------------------------------------------------------------------------
    def _collective(self, operation: str, post: Any) -> Handle:
        def run(progress: Progress) -> None:
            # The Work object dies here, not in a handle the caller may keep: a Gloo work that outlives its process
            # group holds tensors whose release at interpreter exit needs the GIL and aborts the process.
            progress.add("every rank")
            work = post()
            if isinstance(work, dist.Work):
                self._wait(work, "hear from every rank", progress, None)

        return self._thread.submit(operation, run)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        reduce_op = dist.ReduceOp.AVG if op == "avg" and self.backend == "nccl" else dist.ReduceOp.SUM

        def post() -> dist.Work:
            work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)
            if op == "avg" and reduce_op == dist.ReduceOp.SUM:
                work.wait(datetime.timedelta(seconds=self.timeout))
                tensor.div_(self.size)
            return work

        return self._collective(f"all_reduce({op}) of {tensor.dtype}{list(tensor.shape)}", post)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        return self._collective(
            f"broadcast from rank {src}", lambda: dist.broadcast(tensor, self._global(src), self.group, async_op=True)
        )

    def barrier(self, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        if self.backend == "gloo":
            # monitored_barrier names the ranks that did not arrive.
            def run(progress: Progress) -> None:
                try:
                    dist.monitored_barrier(self.group, datetime.timedelta(seconds=timeout), wait_all_ranks=True)
                except RuntimeError as error:
                    raise CommTimeoutError(f"rank {self.rank}: barrier failed: {error}") from error

            self._thread.call("barrier", run, timeout + 5.0)
        else:
            self._collective("barrier", lambda: dist.barrier(self.group, async_op=True)).wait(timeout)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._thread.call("all_gather_object", lambda progress: dist.all_gather_object(out, obj, self.group))
        return out

    def close(self) -> None:
        """Barrier (when healthy), then destroy the process group if this communicator created it; a clean exit
        needs both. An adopted group stays alive: its creator destroys it."""
        if self._closed:
            return
        self._closed = True
        healthy = self._thread.failure is None
        try:
            if healthy:
                self.barrier()
        except GossipError:
            healthy = False
        finally:
            self._thread.stop(timeout=1.0 if healthy else 0.0)
            if self.owns_group and dist.is_initialized():
                self._destroy_process_group()

    def _destroy_process_group(self) -> None:
        """Destroy the default group and check that it is gone: its threads must not live into interpreter exit."""
        group = dist.group.WORLD
        dist.destroy_process_group()
        # Free what still refers to Gloo objects (cycles, finished handles) while the interpreter is fully alive,
        # instead of during finalization, when a Gloo thread releasing a tensor cannot take the GIL.
        gc.collect()
        holders = sys.getrefcount(group) - 2  # minus `group` and getrefcount's argument
        if holders > 0:
            warnings.warn(
                f"rank {self.rank}: the {self.backend} process group is still referenced {holders} time(s) after "
                "destroy_process_group (e.g. by a function default `group=dist.group.WORLD` of a module imported "
                "after gossip.init), so its threads run until interpreter exit, where they can abort the process",
                RuntimeWarning,
                stacklevel=3,
            )
