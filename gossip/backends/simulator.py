"""An in-process communicator: ``n`` virtual ranks, one thread each, the oracle for the real backends.

``simulate(n, fn)`` runs ``fn(comm)`` on ``n`` threads, each with its own :class:`SimulatorCommunicator`, and
returns the ``n`` results in rank order. The primitives behave as on a real backend -- same validation, same
headers, same errors, same timeouts -- and the numbers are deterministic: a message is copied when it is sent,
an all-reduce sums in rank order, so nothing depends on how the threads interleave. Messages from one rank to
another are matched to receives in the order both were posted, as MPI and Gloo match them: the k-th message
from a peer fills the k-th receive posted for that peer, whichever handle is waited for first. When one rank raises, the
others stop waiting at once with :class:`PeerFailedError` and ``simulate`` re-raises the first root cause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gossip.backends.base import Communicator
from gossip.backends.comm_thread import Handle
from gossip.backends.wire import CLOSING, Transfer, check_header, exchange_name
from gossip.errors import (
    CommTimeoutError,
    ExchangeMismatchError,
    GossipError,
    InvalidArgumentError,
    PeerFailedError,
    UseAfterCloseError,
)


class _World:
    """Shared state of the virtual ranks: mailboxes, collective rendezvous, failure."""

    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        # (source, destination) -> {message number: (header, payload)}; numbered as sent, and receives take a
        # number as they are posted, so the n-th receive gets the n-th message.
        self.mail: dict[tuple[int, int], dict[int, tuple[list[int], torch.Tensor]]] = {}
        self.sent: dict[tuple[int, int], int] = {}
        self.posted: dict[tuple[int, int], int] = {}
        self.rounds: dict[int, dict[int, tuple[str, Any]]] = {}
        self.results: dict[int, list[Any]] = {}
        self.readers: dict[int, int] = {}
        self.failed: tuple[int, BaseException] | None = None

    def _raise_if_failed(self, rank: int) -> None:
        if self.failed is not None and self.failed[0] != rank:
            peer, error = self.failed
            raise PeerFailedError(f"rank {rank}: peer rank {peer} failed: {error}")

    def wait_for(
        self, rank: int, ready: Callable[[], bool], timeout: float, operation: str, missing: Callable[[], str]
    ) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not ready():
                self._raise_if_failed(rank)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError(
                        f"rank {rank}: {operation} timed out after {timeout:.1f} s; still waiting for {missing()}"
                    )
                self.cond.wait(remaining)

    def fail(self, rank: int, error: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = (rank, error)
            self.cond.notify_all()


class _ExchangeHandle(Handle):
    def __init__(self, comm: SimulatorCommunicator, recvs: list[Transfer], tickets: list[int], seq: int):
        self._comm, self._recvs, self._tickets, self._seq, self._done = comm, recvs, tickets, seq, not recvs

    def _has(self, transfer: Transfer, ticket: int) -> bool:
        return ticket in self._comm._world.mail.get((transfer.peer, self._comm.rank), {})

    def _arrived(self) -> bool:
        return all(self._has(t, k) for t, k in zip(self._recvs, self._tickets, strict=True))

    def _crossed(self) -> bool:
        """A message arrived from a peer in ``close()`` while this rank exchanges, or the reverse: its header
        names the mismatch at once (as on Gloo and MPI), whatever else is still missing."""
        mail, mine = self._comm._world.mail, self._seq <= CLOSING
        return any(
            (mail[(t.peer, self._comm.rank)][k][0][1] <= CLOSING) != mine
            for t, k in zip(self._recvs, self._tickets, strict=True)
            if self._has(t, k)
        )

    def done(self) -> bool:
        with self._comm._world.cond:
            return self._done or self._arrived()

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        comm, world = self._comm, self._comm._world
        start = time.perf_counter()

        def missing() -> str:
            pairs = zip(self._recvs, self._tickets, strict=True)
            return ", ".join(t.describe("receive from") for t, k in pairs if not self._has(t, k))

        peers = sorted({t.peer for t in self._recvs})
        operation = f"{exchange_name(self._seq)} with peer(s) {peers}"
        try:
            world.wait_for(
                comm.rank,
                lambda: self._arrived() or self._crossed(),
                comm.timeout if timeout is None else timeout,
                operation,
                missing,
            )
            with world.cond:
                if self._crossed():
                    for transfer, ticket in zip(self._recvs, self._tickets, strict=True):
                        if self._has(transfer, ticket):
                            check_header(
                                world.mail[(transfer.peer, comm.rank)][ticket][0], transfer, self._seq, comm.rank
                            )
                pairs = zip(self._recvs, self._tickets, strict=True)
                messages = [world.mail[(t.peer, comm.rank)].pop(k) for t, k in pairs]
            for transfer, (header, payload) in zip(self._recvs, messages, strict=True):
                check_header(header, transfer, self._seq, comm.rank)
                transfer.tensor.copy_(payload)
            self._done = True
        except GossipError as error:
            comm._failure = comm._failure or error
            raise
        finally:
            self.wait_seconds += time.perf_counter() - start


class _DoneHandle(Handle):
    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


class SimulatorCommunicator(Communicator):
    """One virtual rank of a :func:`simulate` run.

    Args:
        world: the state the virtual ranks share.
        rank: this virtual rank.
        local_size: ranks per virtual node.
        timeout: seconds that bound every wait.
        device: where the ranks' tensors live; None is the CPU.
    """

    backend = "simulator"
    ranks_share_a_process = True

    def __init__(self, world: _World, rank: int, local_size: int, timeout: float, device: torch.device | None = None):
        super().__init__()
        self._world = world
        self.rank, self.size = rank, world.size
        self.local_size, self.local_rank = local_size, rank % local_size
        self.device = torch.device("cpu") if device is None else device
        self.timeout = timeout
        self._rounds = 0
        self._failure: GossipError | None = None
        self._closed = False

    def _check_usable(self, operation: str) -> None:
        if self._closed:
            raise UseAfterCloseError(f"rank {self.rank}: {operation} refused: this communicator was closed")
        if self._failure is not None:
            raise UseAfterCloseError(
                f"rank {self.rank}: {operation} refused: this communicator is unusable after an earlier "
                f"failure: {self._failure}"
            )

    def _start_exchange(self, sends: list[Transfer], recvs: list[Transfer], seq: int) -> Handle:
        self._check_usable(exchange_name(seq))
        world = self._world
        with world.cond:
            world._raise_if_failed(self.rank)
            for transfer in sends:
                channel = (self.rank, transfer.peer)
                number = world.sent.get(channel, 0)
                world.sent[channel] = number + 1
                world.mail.setdefault(channel, {})[number] = (transfer.header(seq), transfer.tensor.clone())
            tickets = []
            for transfer in recvs:
                channel = (transfer.peer, self.rank)
                tickets.append(world.posted.get(channel, 0))
                world.posted[channel] = tickets[-1] + 1
            world.cond.notify_all()
        return _ExchangeHandle(self, recvs, tickets, seq)

    def _collective(self, kind: str, payload: Any, combine: Callable[[list[Any]], Any]) -> Any:
        """Rendezvous of all ranks on their k-th collective; ``combine`` sees the payloads in rank order."""
        self._check_usable(kind)
        world, index = self._world, self._rounds
        self._rounds += 1
        with world.cond:
            entries = world.rounds.setdefault(index, {})
            entries[self.rank] = (kind, payload)
            if len(entries) == world.size:
                kinds = {rank: k for rank, (k, _) in entries.items()}
                if len(set(kinds.values())) > 1:
                    error = ExchangeMismatchError(f"collective #{index} differs across ranks: {kinds}")
                    world.failed = world.failed or (self.rank, error)
                    world.cond.notify_all()
                    raise error
                world.results[index] = combine([entries[r][1] for r in range(world.size)])
                world.readers[index] = world.size
                del world.rounds[index]
                world.cond.notify_all()

        def missing() -> str:
            arrived = set(world.rounds.get(index, {}))
            return f"rank(s) {sorted(set(range(world.size)) - arrived)}"

        world.wait_for(self.rank, lambda: index in world.results, self.timeout, f"{kind} #{index}", missing)
        with world.cond:
            result = world.results[index]
            world.readers[index] -= 1
            if world.readers[index] == 0:
                del world.results[index], world.readers[index]
        return result

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        def total(parts: list[tuple[torch.Size, torch.dtype, torch.Tensor]]) -> torch.Tensor:
            if len({(shape, dtype) for shape, dtype, _ in parts}) > 1:
                specs = {rank: f"{dtype}{list(shape)}" for rank, (shape, dtype, _) in enumerate(parts)}
                raise ExchangeMismatchError(f"all_reduce tensors differ across ranks: {specs}")
            acc = parts[0][2].clone()
            for _, _, part in parts[1:]:
                acc += part
            return acc

        result = self._collective("all_reduce", (tensor.shape, tensor.dtype, tensor.clone()), total)
        tensor.copy_(result / self.size if op == "avg" else result)
        return _DoneHandle()

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        result = self._collective(f"broadcast from {src}", tensor.clone(), lambda parts: parts[src])
        if result.shape != tensor.shape or result.dtype != tensor.dtype:
            raise ExchangeMismatchError(
                f"rank {self.rank}: broadcast from {src} sends {result.dtype}{list(result.shape)} "
                f"into {tensor.dtype}{list(tensor.shape)}"
            )
        tensor.copy_(result)
        return _DoneHandle()

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every virtual rank arrives (see :meth:`Communicator.barrier`).

        Args:
            timeout: seconds to wait at most; None waits the communicator's timeout.
        """
        self._collective("barrier", None, lambda parts: None)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every virtual rank's ``obj``, in rank order (see :meth:`Communicator.all_gather_object`).

        Args:
            obj: any object (nothing is pickled).

        Returns:
            One object per rank, index = rank.
        """
        return self._collective("all_gather_object", obj, list)

    def close(self) -> None:
        """Mark this virtual rank closed: every later operation is refused; safe to call twice."""
        self._closed = True


def simulate(
    size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    local_size: int | None = None,
    device: str | torch.device = "cpu",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``size`` virtual ranks; return their results in rank order.

    Each rank runs in its own thread of this process with a :class:`SimulatorCommunicator`.

    Args:
        size: the number of virtual ranks.
        fn: the function every rank runs, given its communicator first.
        *args: further positional arguments of ``fn``.
        timeout: seconds that bound every wait.
        local_size: ranks per virtual node; None puts every rank on one node. Must divide ``size``.
        device: where the ranks' tensors live (``comm.device``), e.g. ``"cuda"``: n virtual ranks share one GPU,
            their kernels ordered on its default stream, messages copied on the device.
        **kwargs: further keyword arguments of ``fn``.

    Returns:
        What ``fn`` returned on each rank, index = rank.

    Raises:
        InvalidArgumentError: ``size`` is below 1, or ``local_size`` does not divide it.
    """
    if size < 1:
        raise InvalidArgumentError(f"simulate needs at least one rank, got size={size}")
    local_size = size if local_size is None else local_size
    if local_size < 1 or size % local_size:
        raise InvalidArgumentError(f"simulate: local_size {local_size} must divide size {size}")
    world = _World(size)
    device = torch.device(device)
    results: list[Any] = [None] * size
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device.index or 0)  # per thread: a new thread starts on device 0
            results[rank] = fn(SimulatorCommunicator(world, rank, local_size, timeout, device), *args, **kwargs)
        except BaseException as error:
            errors[rank] = error
            world.fail(rank, error)

    if device.type == "cuda":
        # torch loads its CUDA linear-algebra library lazily, and that first load is not thread-safe (ranks
        # reaching it at once fail with "lazy wrapper should be called at most once"): load it here, once.
        torch.linalg.qr(torch.eye(2, device=device))
    threads = [threading.Thread(target=run, args=(r,), name=f"sim-rank-{r}") for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        root = [e for _, e in sorted(errors.items()) if not isinstance(e, PeerFailedError)]
        raise (root or [errors[min(errors)]])[0]
    return results
