"""torch.distributed communicator: Gloo on CPU, NCCL on GPU, one code path.

Transfers run on a :class:`CommThread`. Gloo moves bytes on its own I/O threads, so the comm thread only posts
the operations and waits on them; receives are always posted together with sends (a blocking Gloo send is a
rendezvous: two peers that both send first deadlock). NCCL ignores tags but keeps per-pair order, which is all
the header/payload protocol needs. Headers are checked once per peer (see :mod:`gossip.backends.base`): on a
steady step every message goes out in one ``batch_isend_irecv``, and under NCCL the step never waits on the host:
``Work.wait()`` only orders the CUDA stream after the transfers, and this thread completes the steady headers'
check and the timeout in the background (a CUDA event per exchange), before its next operation; an error found
there is raised by that operation. A send refused when it is posted (Gloo: the peer's connection is already
closed) is re-raised as :class:`PeerFailedError` naming the peer. A peer that dies while this rank waits
surfaces as Gloo's "connection closed" and is re-raised as :class:`PeerFailedError` naming the peer; a peer that
never answers as :class:`CommTimeoutError` naming it. Limitation: a tensor changed on one end only is named on
Gloo (the ends disagree about the header round, and each reads the other's header); under NCCL, where the payload
receives are posted before the header is read, it ends in the timeout naming the peer. An uncaught error after
such a failure ends the process with status 1 without running Gloo's teardown (:mod:`gossip.backends.exit_guard`).
"""

from __future__ import annotations

import datetime
import gc
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

# Functions declared with ``group=dist.group.WORLD`` defaults capture the default process group itself when their
# module is first imported after init_process_group (torch.optim imports this one lazily, through torch._dynamo).
# That reference outlives destroy_process_group, and with it Gloo's worker and I/O threads, into interpreter
# teardown. Imported here, before any process group exists, the defaults are None.
import torch.distributed.nn.functional

from gossip.backends.base import Communicator
from gossip.backends.comm_thread import CommThread, Handle, Progress
from gossip.backends.exit_guard import watch
from gossip.backends.launch_env import LaunchInfo
from gossip.backends.wire import (
    HEADER_LEN,
    HEADER_TAG,
    PAYLOAD_TAG,
    LayoutHistory,
    Transfer,
    check_header,
    check_steady_header,
    exchange_name,
    signature,
    steady_header,
)
from gossip.errors import CommTimeoutError, GossipError, PeerFailedError, ProcessGroupLeakWarning


class TorchDistCommunicator(Communicator):
    """A communicator on a torch.distributed process group (``backend`` is "gloo" or "nccl").

    By default it creates the default group (``init_process_group``) and destroys it in :meth:`close`. With
    ``adopt=group`` it runs on a group the caller already created -- the default group (``dist.group.WORLD``) or
    a subgroup from ``new_group`` -- whose ranks ``info`` gives; it then leaves the group alive at :meth:`close`
    and, on NCCL, uses the CUDA device the caller selected.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        info: this process's launch information (rank, size, local rank and size).
        init_method: the rendezvous URL (``tcp://host:port``), or None for torch's ``env://``.
        timeout: seconds that bound every wait.
        adopt: a process group the caller created, to run on instead of creating one.
        **init: further keyword arguments of ``init_process_group``.
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
        # per peer: the layouts exchanged so far (what this rank sends it, what it receives from it), which predict
        # the next steady one; any other is checked by a per-tensor header exchange
        self._layouts: dict[int, LayoutHistory] = {}
        self._pending: list[tuple] = []  # NCCL exchanges posted, not yet known to be complete and checked
        watch(self)

    @property
    def failure(self) -> BaseException | None:
        """The first error of this communicator (None while healthy); after it every operation is refused."""
        return self._thread.failure

    # -- helpers --------------------------------------------------------------------------------------------
    def _global(self, peer: int) -> int:
        """torch.distributed addresses peers by their rank in the default group."""
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def _local(self, peer: int) -> int:
        """This communicator's rank of a peer that torch.distributed names by its default-group rank."""
        return peer if self.group is None else dist.get_group_rank(self.group, peer)

    def _p2p(self, op: Any, tensor: torch.Tensor, peer: int, tag: int) -> dist.P2POp:
        """A point-to-point operation with ``peer`` (this communicator's rank) on this communicator's group."""
        return dist.P2POp(op, tensor, self._global(peer), self.group, tag=tag)

    def _wait(self, work: dist.Work, part: str, progress: Progress, peer: int | None, count: bool = True) -> None:
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
        if count:
            progress.finish(part)

    # -- point to point -------------------------------------------------------------------------------------
    def _post(self, ops: list[dist.P2POp], what: str, progress: Progress) -> list[dist.Work]:
        """Post ``ops`` (``batch_isend_irecv``); a failure to post names the peer concerned.

        Gloo refuses a send to a peer whose connection is already closed (SIGKILLed, crashed) at once, with a raw
        "Connection closed by peer": that becomes :class:`PeerFailedError` naming the peer. Backends that do not
        coalesce post one operation at a time anyway, so each is posted alone and the one refused names its peer;
        NCCL coalesces the batch into one work, and a refused batch names the peers of all its operations.
        """
        if not ops:
            return []
        batches = [ops] if self.backend == "nccl" else [[op] for op in ops]
        works: list[dist.Work] = []
        for batch in batches:
            try:
                works += dist.batch_isend_irecv(batch)
            except RuntimeError as error:
                peers = sorted({self._local(op.peer) for op in batch})
                who = f"peer {peers[0]}" if len(peers) == 1 else f"one of peers {peers}"
                raise PeerFailedError(
                    f"rank {self.rank}: {progress.operation}: {who} failed or closed its connection before this "
                    f"rank could {what}: {str(error).splitlines()[0]}"
                ) from error
        return works if len(works) == len(ops) else works * len(ops)  # NCCL coalesces the batch into one work

    def _handshake(
        self, peers: list[int], sends: dict[int, list[Transfer]], recvs: dict[int, list[Transfer]], seq: int,
        progress: Progress,
    ) -> None:  # fmt: skip
        """Per-tensor headers with ``peers``, each checked against its receive buffer before any payload moves.

        A host read of every header: under NCCL a synchronisation, paid only here (first exchange with a peer, or
        tensors not as predicted), never on a steady step.
        """
        ops: list[dist.P2POp] = []
        headers = []
        for peer in peers:
            for transfer in sends[peer]:
                header = torch.tensor(transfer.header(seq), dtype=torch.int64, device=self.device)
                ops.append(self._p2p(dist.isend, header, peer, HEADER_TAG))
                headers.append((transfer, None))
            for transfer in recvs[peer]:
                buffer = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                ops.append(self._p2p(dist.irecv, buffer, peer, HEADER_TAG))
                headers.append((transfer, buffer))
        works = self._post(ops, "exchange headers", progress)
        for (transfer, buffer), work in zip(headers, works, strict=True):
            if buffer is not None:
                part = f"receive the header of {transfer.describe('receive from')}"
                self._wait(work, part, progress, transfer.peer, count=False)
                check_header(buffer.tolist(), transfer, seq, self.rank)
        for (transfer, buffer), work in zip(headers, works, strict=True):
            if buffer is None:
                self._wait(work, f"send a header to peer {transfer.peer}", progress, transfer.peer, count=False)

    def _start_exchange(self, sends: list[Transfer], recvs: list[Transfer], seq: int) -> Handle:
        peers = sorted({t.peer for t in sends} | {t.peer for t in recvs})
        to = {peer: [t for t in sends if t.peer == peer] for peer in peers}
        frm = {peer: [t for t in recvs if t.peer == peer] for peer in peers}
        keys = {peer: (signature(to[peer]), signature(frm[peer])) for peer in peers}
        # receives first, then sends: this rank's small messages go out before its bulk data on each connection,
        # so the two directions of a pair are not serialised behind each other on a rate-limited link.
        payloads = [(t, "receive from", dist.irecv) for t in recvs] + [(t, "send to", dist.isend) for t in sends]

        def run(progress: Progress) -> None:
            self._check_pending()
            for transfer, direction, _ in payloads:
                progress.add(transfer.describe(direction))
            # 1. peers met for the first time, or whose tensors are not as predicted: per-tensor headers, checked one
            #    by one.
            histories = {peer: self._layouts.setdefault(peer, LayoutHistory()) for peer in peers}
            fresh = [peer for peer in peers if histories[peer].predicted() != keys[peer]]
            if fresh:
                self._handshake(fresh, to, frm, seq, progress)
            for peer in peers:
                histories[peer].record(keys[peer])
            # 2. one batch: a steady header to and from every other peer, every payload receive, every payload send.
            ops, steady = [], []
            for peer in peers:
                if peer not in fresh:
                    out = torch.tensor(steady_header(seq, to[peer], frm[peer]), dtype=torch.int64, device=self.device)
                    incoming = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                    ops += [self._p2p(dist.irecv, incoming, peer, HEADER_TAG)]
                    ops += [self._p2p(dist.isend, out, peer, HEADER_TAG)]
                    steady.append((peer, incoming))
            posted = [(t, direction, op) for t, direction, op in payloads if t.tensor.numel()]
            for transfer, direction, _ in payloads:
                if not transfer.tensor.numel():
                    progress.finish(transfer.describe(direction))
            ops += [self._p2p(op, t.tensor, t.peer, PAYLOAD_TAG) for t, _, op in posted]
            works = self._post(ops, "post its messages", progress)
            header_works, payload_works = works[: 2 * len(steady)], works[2 * len(steady) :]
            if self.backend == "nccl":
                self._order_after(steady, header_works, payload_works, posted, seq, to, frm, progress)
                return
            # 3. Gloo: the steady headers first, so that a mismatch is named before waiting on payloads that may
            #    never come; the check is a read of a CPU tensor.
            for (peer, incoming), work in zip(steady, header_works[0::2], strict=True):
                self._wait(work, f"receive the header of peer {peer}", progress, peer, count=False)
                check_steady_header(incoming.tolist(), peer, seq, self.rank, to[peer], frm[peer])
            for (peer, _), work in zip(steady, header_works[1::2], strict=True):
                self._wait(work, f"send its header to peer {peer}", progress, peer, count=False)
            for work, (transfer, direction, _) in zip(payload_works, posted, strict=True):
                self._wait(work, transfer.describe(direction), progress, transfer.peer)

        return self._thread.submit(f"{exchange_name(seq)} with peer(s) {peers}", run)

    # -- NCCL: ordering on the GPU, checks in the background ------------------------------------------------
    def _order_after(
        self, steady: list, header_works: list, payload_works: list, posted: list, seq: int,
        to: dict[int, list[Transfer]], frm: dict[int, list[Transfer]], progress: Progress,
    ) -> None:  # fmt: skip
        """Make the current CUDA stream wait for the transfers (``Work.wait()`` without a timeout: no host wait),
        and leave the steady headers' check and the timeout to this thread, before its next operation."""
        for work in (*header_works, *payload_works):
            work.wait()
        for transfer, direction, _ in posted:
            progress.finish(transfer.describe(direction))
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.timeout
        checks = [(peer, incoming, to[peer], frm[peer]) for peer, incoming in steady]
        peers = sorted({peer for peer, _ in steady} | {t.peer for t, _, _ in posted})
        self._pending.append((done, deadline, seq, peers, checks))

    def _check_pending(self) -> None:
        """Complete the checks of earlier NCCL exchanges: wait (on this thread) until each finished on the GPU, at
        most until its deadline, then check its steady headers; raise the named error of the first failure."""
        while self._pending:
            done, deadline, seq, peers, steady = self._pending[0]
            while not done.query():
                if time.monotonic() > deadline:
                    raise CommTimeoutError(
                        f"rank {self.rank}: exchange {seq} timed out after {self.timeout:.1f} s: the transfers with "
                        f"peer(s) {peers} did not complete on the GPU (a peer failed, or is at another step)"
                    )
                time.sleep(1e-4)
            self._pending.pop(0)
            for peer, incoming, sends, recvs in steady:
                check_steady_header(incoming.tolist(), peer, seq, self.rank, sends, recvs)

    # -- collectives ----------------------------------------------------------------------------------------
    def _collective(self, operation: str, post: Any, after: Any = None) -> Handle:
        def run(progress: Progress) -> None:
            # The Work object dies here, not in a handle the caller may keep: a Gloo work that outlives its process
            # group holds tensors whose release at interpreter exit needs the GIL and aborts the process.
            self._check_pending()
            progress.add("every rank")
            try:
                work = post()
            except RuntimeError as error:  # Gloo refuses to post on a connection a dead peer closed
                raise PeerFailedError(
                    f"rank {self.rank}: {progress.operation}: a peer failed or closed its connection before this rank "
                    f"could post it: {str(error).splitlines()[0]}"
                ) from error
            if isinstance(work, dist.Work):
                self._wait(work, "hear from every rank", progress, None)  # a failed peer: PeerFailedError, named
            if after is not None:
                after()

        return self._thread.submit(operation, run)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        reduce_op = dist.ReduceOp.AVG if op == "avg" and self.backend == "nccl" else dist.ReduceOp.SUM
        divide = (lambda: tensor.div_(self.size)) if op == "avg" and reduce_op == dist.ReduceOp.SUM else None
        return self._collective(
            f"all_reduce({op}) of {tensor.dtype}{list(tensor.shape)}",
            lambda: dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True),
            divide,
        )

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        return self._collective(
            f"broadcast from rank {src}", lambda: dist.broadcast(tensor, self._global(src), self.group, async_op=True)
        )

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every rank arrives (see :meth:`Communicator.barrier`).

        Args:
            timeout: seconds to wait at most; None waits the communicator's timeout.

        Raises:
            CommTimeoutError: a rank did not arrive in time; the message names this rank.
        """
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
        """Every rank's picklable ``obj``, in rank order (see :meth:`Communicator.all_gather_object`).

        Args:
            obj: a picklable object.

        Returns:
            One object per rank, index = rank.

        Raises:
            CommTimeoutError: a rank did not take part in time.
            PeerFailedError: the collective failed otherwise (a peer closed its connection).
        """
        out: list[Any] = [None] * self.size

        def run(progress: Progress) -> None:
            self._check_pending()
            progress.add("the other ranks to join all_gather_object")
            try:
                dist.all_gather_object(out, obj, self.group)
            except RuntimeError as error:  # Gloo's own timeout, or a peer's connection closed
                text = str(error).splitlines()[0]
                if "timed out" in text.lower() or "timeout" in text.lower():
                    raise CommTimeoutError(f"rank {self.rank}: all_gather_object timed out: {text}") from error
                raise PeerFailedError(
                    f"rank {self.rank}: all_gather_object: a peer failed or closed its connection: {text}"
                ) from error

        self._thread.call("all_gather_object", run)
        return out

    def close(self) -> None:
        """Barrier (when healthy), then destroy the process group if this communicator created it.

        A clean exit needs both. An adopted group stays alive: its creator destroys it.
        """
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
                ProcessGroupLeakWarning,
                stacklevel=3,
            )
