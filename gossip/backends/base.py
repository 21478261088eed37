"""The communicator interface every backend implements, and the pieces they share.

A communicator offers a handful of primitives with identical semantics on every backend:

* ``rank``, ``size``, ``local_rank``, ``local_size``;
* ``exchange(sends, recvs, seq=...)``: in one non-blocking call, send these contiguous tensors to these peers and
  receive into those tensors from those peers; returns a :class:`Handle` whose ``wait(timeout)`` completes it;
* ``plan_exchange(sends, recvs)`` and ``start_planned(plan, seq=...)``: the same exchange split in two, for
  buffers an algorithm sends and receives into at every step: the tensors are checked and numbered once, and each
  step only posts them (:class:`PlannedExchange`);
* ``all_reduce`` (sum or average, in place), ``broadcast``, ``barrier``, ``all_gather_object``, ``close``.

The wire protocol of ``exchange``. Every tensor travels behind a small int64 header
``[MAGIC, seq, index, count, dtype code, numel]``. The receiver reads the header first and compares it with the
buffer it posted, so a wrong dtype, a wrong size, a different number of tensors or a peer that is at another
sequence number (another step) raises :class:`ExchangeMismatchError` naming the peer -- instead of Gloo
aborting the process on a too-small buffer or silently accepting a wrong dtype. The payload receive is posted
only after its header matched. Messages between one pair of ranks are delivered in order (MPI and Gloo both
guarantee this per tag), so headers and payloads travel on two tags.

Checked once, then trusted (torch.distributed): the per-tensor headers travel only at the first exchange with a
peer and again when what this rank sends to or expects from that peer (its :func:`signature`) is not what the
pair's earlier exchanges predict (:class:`LayoutHistory`: the same as last time, or, for messages that cycle
through a few layouts like PowerGossip's left and right products, the next layout of the cycle). Every other
exchange sends one *steady* header per peer, ``[MAGIC, seq, STEADY, count, digest of what it sends, digest of
what it expects]``, posted together with the payloads: a peer at another step, or one whose tensors changed
while this rank's did not, is still named (:func:`check_steady_header`) without a header round trip.

Closing. ``DecentralizedDataParallel.close()`` ends with :meth:`Communicator.closing_handshake`: one message to and
from the peers of the exchange that would come next, numbered :func:`closing_seq` (below :data:`CLOSING`, never an
exchange's number). A rank that took one more optimizer step than its peers is inside that very exchange, so the
two messages cross and the header checks name it on both ends, at once, instead of a timeout.

Send buffers must not be modified until the handle's ``wait`` returns. Receive buffers hold the peer's data
when ``wait`` returns.
"""

from __future__ import annotations

import abc
import concurrent.futures
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from gossip.errors import (
    ArgumentTypeError,
    CommTimeoutError,
    ExchangeMismatchError,
    InvalidArgumentError,
    UseAfterCloseError,
)

MAGIC = 0x60551B
HEADER_LEN = 6
HEADER_TAG = 7
PAYLOAD_TAG = 8
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.uint8: 7,
    torch.int8: 8,
    torch.bool: 9,
}
_CODE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPE_CODES.items()}
REDUCE_OPS = ("sum", "avg")
STEADY = -1  # the index field of a steady header: one per peer, announcing tensors already checked
#: Sequence numbers at or below this one announce a rank in ``close()`` (:func:`closing_seq`), not an exchange.
CLOSING = -2


def closing_seq(steps: int) -> int:
    """The sequence number of :meth:`Communicator.closing_handshake` after ``steps`` optimizer steps.

    Args:
        steps: optimizer steps this rank took before ``close()``.

    Returns:
        ``CLOSING - steps``: at or below :data:`CLOSING`, so never an exchange's number.
    """
    return CLOSING - steps


def exchange_name(seq: int) -> str:
    """How messages and errors name the exchange numbered ``seq``.

    Args:
        seq: the exchange's sequence number (at or below :data:`CLOSING` for the closing handshake).

    Returns:
        ``"exchange <seq>"``, or ``"close() after <k> optimizer steps"`` for a closing sequence number.
    """
    return f"close() after {CLOSING - seq} optimizer steps" if seq <= CLOSING else f"exchange {seq}"


def _closing_mismatch(where: str, peer: int, seq: int, their_seq: int) -> str | None:
    """The message for a rank in ``close()`` meeting a peer that still exchanges (either end), else None."""
    if seq <= CLOSING and their_seq <= CLOSING and seq != their_seq:
        return (
            f"{where}: peer {peer} is in close() after {CLOSING - their_seq} optimizer steps: the two ranks took "
            "different numbers of steps; every rank must take the same number"
        )
    if (seq <= CLOSING) == (their_seq <= CLOSING):
        return None
    hint = (
        "an optimizer.step() without a forward is a mixing-only step, which puts the rank that took it one "
        "exchange ahead of its peers; every rank must take the same number of steps"
    )
    if their_seq <= CLOSING:
        return (
            f"{where}: peer {peer} is in close() after {CLOSING - their_seq} optimizer steps: this rank took more "
            f"steps than peer {peer} ({hint})"
        )
    return f"{where} belongs to exchange {their_seq}: peer {peer} took more steps than this rank ({hint})"


@dataclass(frozen=True)
class Transfer:
    """One tensor to or from one peer, the ``index``-th of ``count`` with that peer in this exchange.

    Attributes:
        peer: the other rank.
        tensor: the contiguous tensor sent, or received into.
        index: its position among the tensors exchanged with ``peer``, from 0.
        count: how many tensors this exchange carries with ``peer`` in this direction.
    """

    peer: int
    tensor: torch.Tensor
    index: int
    count: int

    @property
    def nbytes(self) -> int:
        """Payload bytes of the tensor (``numel * element_size``)."""
        return self.tensor.numel() * self.tensor.element_size()

    def header(self, seq: int) -> list[int]:
        """The per-tensor header announcing this tensor: ``[MAGIC, seq, index, count, dtype code, numel]``.

        Args:
            seq: the exchange's sequence number.

        Returns:
            The :data:`HEADER_LEN` integers of the header.
        """
        return [MAGIC, seq, self.index, self.count, DTYPE_CODES[self.tensor.dtype], self.tensor.numel()]

    def describe(self, direction: str) -> str:
        """How errors name this transfer.

        Args:
            direction: ``"send to"`` or ``"receive from"`` (any verb phrase placed before the peer).

        Returns:
            ``"<direction> peer <p> (tensor <i>/<count>)"``.
        """
        return f"{direction} peer {self.peer} (tensor {self.index + 1}/{self.count})"


def _spec(code: int, numel: int) -> str:
    return f"{_CODE_NAMES.get(code, f'dtype code {code}')}[{numel}]"


def check_header(header: Sequence[int], expected: Transfer, seq: int, rank: int) -> None:
    """Raise :class:`ExchangeMismatchError` unless ``header`` announces exactly what ``expected`` can hold.

    Args:
        header: the per-tensor header the peer sent (see :meth:`Transfer.header`).
        expected: the receive posted for it on this rank.
        seq: this rank's sequence number for the exchange.
        rank: this rank, for the message.

    Raises:
        ExchangeMismatchError: the header is not a gossip-train header, or its sequence number, index, count, dtype
            or size differs from what this rank expects; the message names the peer.
    """
    magic, their_seq, index, count, code, numel = (int(v) for v in header)
    where = f"rank {rank}: {exchange_name(seq)}: message from peer {expected.peer}"
    if magic != MAGIC:
        raise ExchangeMismatchError(f"{where} is not a gossip-train header (magic {magic:#x})")
    closing = _closing_mismatch(where, expected.peer, seq, their_seq)
    if closing is not None:
        raise ExchangeMismatchError(closing)
    if index == STEADY:
        raise ExchangeMismatchError(
            f"{where}: peer {expected.peer} sends and expects what it did before, while rank {rank} changed what it "
            "sends to or expects from it: both ends must change their tensors at the same exchange"
        )
    if their_seq != seq:
        raise ExchangeMismatchError(
            f"{where} belongs to exchange {their_seq}: the two ranks are at different steps or their schedules disagree"
        )
    if count != expected.count:
        raise ExchangeMismatchError(
            f"{where}: peer {expected.peer} sends {count} tensor(s), rank {rank} expects {expected.count}"
        )
    mine = (DTYPE_CODES[expected.tensor.dtype], expected.tensor.numel())
    if index != expected.index or (code, numel) != mine:
        raise ExchangeMismatchError(
            f"{where}: tensor {index + 1}/{count} is {_spec(code, numel)} but the receive buffer is {_spec(*mine)}"
        )


def signature(transfers: Sequence[Transfer]) -> tuple[tuple[int, int], ...]:
    """What a list of transfers with one peer carries: (dtype code, numel) per tensor, in order.

    Args:
        transfers: the transfers with one peer in one direction.

    Returns:
        One ``(dtype code, numel)`` pair per transfer.
    """
    return tuple((DTYPE_CODES[t.tensor.dtype], t.tensor.numel()) for t in transfers)


def digest(sig: tuple[tuple[int, int], ...]) -> int:
    """A digest of a :func:`signature`, equal on every process (CRC-32 of its text).

    Args:
        sig: a :func:`signature`.

    Returns:
        The CRC-32 of ``repr(sig)``, an integer in ``[0, 2^32)``.
    """
    return zlib.crc32(repr(sig).encode())


class LayoutHistory:
    """Which layout the next exchange with one peer is predicted to carry.

    A layout is a pair of :func:`signature` s: what this rank sends a peer, what it expects from it. An exchange that
    matches the prediction is *steady* (no per-tensor headers), any other re-checks its tensors.

    The prediction: the layout of ``p`` exchanges ago, for the shortest period ``p`` (up to ``MAX_PERIOD``) over
    which the last ``2 p`` exchanges repeat; without one, the last layout. An unchanged layout is steady from its
    second exchange, and a cycle of a few layouts -- PowerGossip's products alternate between the left and the
    right side (two sizes), and with the uncompressed tensors in a step's first message only, an odd number of
    power iterations makes a cycle of 2 x iterations -- once it has been seen twice, where "the same as last time"
    would re-check every exchange (under NCCL a host sync each). Safe because both ends of a pair make every
    exchange together, so they hold the same history and predict the same layout: both go steady only when both
    carry the predicted (so each other's) layout, and an end that does not re-checks, which names the
    disagreement. (Trusting every layout checked before would not be: two ends on different such layouts would
    both go steady, and a Gloo receive posted for fewer bytes than arrive aborts the process.)
    """

    MAX_PERIOD = 16

    def __init__(self) -> None:
        self.recent: list[tuple] = []  # the last 2 x MAX_PERIOD layouts, oldest first

    def predicted(self) -> tuple | None:
        """The layout a steady exchange carries next; None before the first exchange.

        Returns:
            The predicted ``(sends signature, receives signature)`` pair, or None when there is no history yet.
        """
        recent = self.recent
        for period in range(1, len(recent) // 2 + 1):
            if recent[-period:] == recent[-2 * period : -period]:
                return recent[-period]
        return recent[-1] if recent else None

    def record(self, layout: tuple) -> None:
        """``layout`` was exchanged (checked now or steady).

        Args:
            layout: the ``(sends signature, receives signature)`` pair the exchange carried.
        """
        self.recent.append(layout)
        del self.recent[: -2 * self.MAX_PERIOD]


def steady_header(seq: int, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> list[int]:
    """The one header per peer of a steady exchange: ``[MAGIC, seq, STEADY, count, digest(sends), digest(recvs)]``.

    Args:
        seq: the exchange's sequence number.
        sends: the transfers this rank sends the peer.
        recvs: the transfers this rank receives from the peer.

    Returns:
        The :data:`HEADER_LEN` integers of the header.
    """
    return [MAGIC, seq, STEADY, len(sends), digest(signature(sends)), digest(signature(recvs))]


def check_steady_header(
    header: Sequence[int], peer: int, seq: int, rank: int, sends: Sequence[Transfer], recvs: Sequence[Transfer]
) -> None:
    """Raise :class:`ExchangeMismatchError` unless ``header`` is ``peer``'s steady header matching this exchange.

    Args:
        header: the header ``peer`` sent.
        peer: the rank that sent it.
        seq: this rank's sequence number for the exchange.
        rank: this rank, for the message.
        sends: what this rank sends ``peer`` (the peer's header must expect it).
        recvs: what this rank expects from ``peer`` (the peer's header must announce it).

    Raises:
        ExchangeMismatchError: the header is not a steady gossip-train header, or ``peer`` is at another sequence
            number, or what it sends or expects differs from this rank's; the message names the peer.
    """
    magic, their_seq, index, count, their_sends, their_recvs = (int(v) for v in header)
    where = f"rank {rank}: {exchange_name(seq)}: message from peer {peer}"
    if magic != MAGIC:
        raise ExchangeMismatchError(f"{where} is not a gossip-train header (magic {magic:#x})")
    closing = _closing_mismatch(where, peer, seq, their_seq)
    if closing is not None:
        raise ExchangeMismatchError(closing)
    if index != STEADY:
        raise ExchangeMismatchError(
            f"{where}: peer {peer} changed what it sends or expects and re-checks it, while rank {rank} sends and "
            "expects what it did before: both ends must change their tensors at the same exchange"
        )
    if their_seq != seq:
        raise ExchangeMismatchError(
            f"{where} belongs to exchange {their_seq}: the two ranks are at different steps or their schedules disagree"
        )
    if their_sends != digest(signature(recvs)) or their_recvs != digest(signature(sends)) or count != len(recvs):
        raise ExchangeMismatchError(
            f"{where}: peer {peer} sends {count} tensor(s) laid out unlike the {len(recvs)} receive buffer(s) of "
            f"rank {rank} {list(signature(recvs))} (or expects other tensors than rank {rank} sends), although both "
            "were checked before: the two ends changed their tensors at different exchanges"
        )


def _check_tensor(tensor: Any, what: str | Callable[[], str], device: torch.device) -> torch.Tensor:
    """``tensor`` if this communicator can move it (detached if it has a gradient), else a named error. ``what``
    names it in the error: a string, or a callable building one (every message of every step passes here, so the
    name is built only for an error)."""
    if (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype in DTYPE_CODES
        and tensor.is_contiguous()
        and tensor.device.type == device.type
    ):
        return tensor.detach() if tensor.requires_grad else tensor
    what = what() if callable(what) else what
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPE_CODES:
        raise ArgumentTypeError(f"{what} has dtype {tensor.dtype}; supported: {', '.join(_CODE_NAMES.values())}")
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{what} is not contiguous; pass a contiguous (flat) buffer")
    raise InvalidArgumentError(f"{what} is on {tensor.device} but this communicator moves {device.type} tensors")


def plan_transfers(
    pairs: Sequence[tuple[int, torch.Tensor]], direction: str, rank: int, size: int, device: torch.device
) -> list[Transfer]:
    """Validate ``(peer, tensor)`` pairs and number the tensors per peer in the order given.

    Args:
        pairs: ``(peer, tensor)`` for each tensor to send or receive into.
        direction: ``"send to"`` or ``"receive from"``, for messages.
        rank: this rank (a peer must be another rank).
        size: the number of ranks.
        device: the device this communicator moves tensors on.

    Returns:
        One :class:`Transfer` per pair, in order, numbered per peer.

    Raises:
        InvalidArgumentError: a peer is not a rank in ``[0, size)`` or is this rank, or a tensor is not contiguous
            or is on another device.
        ArgumentTypeError: a tensor is not a ``torch.Tensor`` or has an unsupported dtype.
    """
    counts: dict[int, int] = {}
    for peer, _ in pairs:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < size:
            raise InvalidArgumentError(f"rank {rank}: {direction} peer {peer!r} is not a rank in [0, {size})")
        if peer == rank:
            raise InvalidArgumentError(
                f"rank {rank}: cannot {direction} itself; keep the local share out of exchange()"
            )
        counts[peer] = counts.get(peer, 0) + 1
    seen: dict[int, int] = {}
    transfers = []
    for peer, tensor in pairs:
        index = seen.get(peer, 0)
        seen[peer] = index + 1
        what = partial("rank {}: tensor {}/{} to {} peer {}".format, rank, index + 1, counts[peer], direction, peer)
        transfers.append(Transfer(peer, _check_tensor(tensor, what, device), index, counts[peer]))
    return transfers


@dataclass(frozen=True)
class PlannedExchange:
    """An exchange's transfers, validated and numbered once, for buffers that stay the same from step to step.

    :meth:`Communicator.start_planned` posts it again and again without re-checking its tensors (as MPI's
    persistent requests, ``MPI_Send_init`` and ``MPI_Start``, set a transfer up once). Built by
    :meth:`Communicator.plan_exchange`; its tensors must keep their dtype, size and memory for as long as the plan
    is used (the wire protocol's headers still announce each tensor as it is at each exchange, so a peer that
    disagrees is still named). ``a + b`` is one exchange carrying both, for plans with different peers.

    Attributes:
        sends: the transfers to send, numbered per peer.
        recvs: the transfers to receive into, numbered per peer.
        nbytes: ``(peer, bytes sent, bytes received)`` per peer, for the traffic accounts.
    """

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    #: (peer, bytes sent to it, bytes received from it), per peer
    nbytes: tuple[tuple[int, int, int], ...]

    def __add__(self, other: PlannedExchange) -> PlannedExchange:
        shared = {peer for peer, _, _ in self.nbytes} & {peer for peer, _, _ in other.nbytes}
        if shared:  # the transfers are numbered per peer within a plan, so one peer's must come from one plan
            raise InvalidArgumentError(
                f"planned exchanges to join share peer(s) {sorted(shared)}; plan each peer's once"
            )
        return PlannedExchange(self.sends + other.sends, self.recvs + other.recvs, self.nbytes + other.nbytes)


#: The peer key under which collective traffic (all-reduce) is recorded in a :class:`Traffic`.
COLLECTIVE = -1


def ring_all_reduce_bytes(nbytes: int, size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes`` over ``size`` ranks.

    2 (n - 1) / n * M (reduce-scatter, then all-gather; Patarasuk and Yuan, JPDC 2009; docs/design.md B.5),
    rounded to a byte. The one count of all-reduce traffic: the communicators' ``all_reduce`` and the DDP
    baseline's gradient buckets both book it.

    Args:
        nbytes: M, the bytes of the reduced tensor.
        size: n, the number of ranks.

    Returns:
        round(2 (n - 1) / n * M); 0 for one rank.
    """
    return round(2 * (size - 1) / size * nbytes)


@dataclass
class Traffic:
    """Payload bytes one rank sent to and received from each peer: cumulative and for the last step.

    Filled by the communicator itself (:meth:`Communicator.exchange` and :meth:`Communicator.all_reduce` given a
    ``traffic``) from the tensors it was handed, so what is counted is what travelled: point-to-point payloads per
    peer (not the protocol's headers), and a collective under :data:`COLLECTIVE` as a ring all-reduce moves it.

    Attributes:
        sent: bytes sent to each peer since the start.
        received: bytes received from each peer since the start.
        last_sent: bytes sent to each peer since the last :meth:`new_step`.
        last_received: bytes received from each peer since the last :meth:`new_step`.
    """

    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    last_sent: dict[int, int] = field(default_factory=dict)
    last_received: dict[int, int] = field(default_factory=dict)

    def new_step(self) -> None:
        """Start a step's account: clear ``last_sent`` and ``last_received``."""
        self.last_sent, self.last_received = {}, {}

    def record(self, peer: int, sent: int, received: int) -> None:
        """Add one exchange's bytes with ``peer`` to the cumulative and the last step's counts.

        Args:
            peer: the other rank (or :data:`COLLECTIVE` for a collective).
            sent: payload bytes sent to it.
            received: payload bytes received from it.
        """
        for total, last, nbytes in ((self.sent, self.last_sent, sent), (self.received, self.last_received, received)):
            total[peer] = total.get(peer, 0) + nbytes
            last[peer] = last.get(peer, 0) + nbytes

    @property
    def total_sent(self) -> int:
        """Payload bytes sent to all peers since the start."""
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        """Payload bytes received from all peers since the start."""
        return sum(self.received.values())


@dataclass
class Progress:
    """What an operation still waits for, kept up to date so that a timeout can name the missing peers.

    Attributes:
        operation: the operation, in words (e.g. ``"exchange 12"``).
        outstanding: the parts not yet complete (e.g. ``"receive from 3"``), in the order added.
    """

    operation: str
    outstanding: dict[str, None] = field(default_factory=dict)

    def add(self, part: str) -> None:
        """Mark ``part`` as outstanding.

        Args:
            part: what the operation waits for, in words.
        """
        self.outstanding[part] = None

    def finish(self, part: str) -> None:
        """Mark ``part`` as complete.

        Args:
            part: a part given to :meth:`add`.
        """
        self.outstanding.pop(part, None)

    def describe(self) -> str:
        """The operation and what it still waits for, for a timeout's message.

        Returns:
            The outstanding parts, comma-separated, or that the operation has yet to return when none is left.
        """
        parts = list(self.outstanding)
        return ", ".join(parts) if parts else f"{self.operation} to return (every transfer is done)"


class Handle(abc.ABC):
    """A started operation. ``wait`` completes it (or raises); ``wait_seconds`` is the time spent blocked."""

    wait_seconds: float = 0.0

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the operation has completed; never blocks and never drives progress itself.

        Returns:
            Whether :meth:`wait` would return at once.
        """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise :class:`CommTimeoutError` naming the missing peers after ``timeout``.

        Args:
            timeout: seconds to wait at most; None waits the communicator's timeout.
        """


class FutureHandle(Handle):
    """A handle on an operation run by a :class:`CommThread`.

    Args:
        future: the future the thread completes.
        progress: the operation's :class:`Progress`, to name what is missing on a timeout.
        owner: the thread running it.
    """

    def __init__(self, future: concurrent.futures.Future, progress: Progress, owner: CommThread):
        self._future = future
        self.progress = progress
        self._owner = owner

    def done(self) -> bool:
        """True once the thread has completed the operation.

        Returns:
            Whether :meth:`wait` would return at once.
        """
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the thread has completed the operation, and raise its error if it failed.

        Args:
            timeout: seconds to wait at most; None waits the thread's timeout.

        Raises:
            error: the operation's own error, or :class:`CommTimeoutError` naming what it still waits for when
                ``timeout`` expires (the thread is then failed, so every later operation says so).
        """
        timeout = self._owner.timeout if timeout is None else timeout
        start = time.perf_counter()
        try:
            self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            error = CommTimeoutError(
                f"rank {self._owner.rank}: {self.progress.operation} timed out after {timeout:.1f} s; "
                f"still waiting for {self._owner.pending_description(self.progress)}"
            )
            self._owner.fail(error)
            raise error from None
        finally:
            self.wait_seconds += time.perf_counter() - start


class CommThread:
    """One thread that runs a communicator's operations in submission order.

    Every rank submits the same operations in the same order, so running them in FIFO order on one thread keeps
    the ranks matched. The thread, not the training thread, drives transfers forward: Gloo progresses by
    itself, while an MPI request only advances inside MPI calls, which this thread makes (polling with short
    sleeps rather than a busy wait, so it does not burn a core that the training needs). After one failure the
    communicator is unusable, as a Gloo process group is after a timeout, and every later operation says so.

    Args:
        name: the thread's name.
        rank: this rank, for messages.
        timeout: seconds a wait lasts by default.
    """

    def __init__(self, name: str, rank: int, timeout: float):
        self.rank = rank
        self.timeout = timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._running: Progress | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, operation: str, run: Callable[[Progress], Any]) -> FutureHandle:
        """Queue ``run`` to run after every operation submitted before it.

        Args:
            operation: the operation, in words, for messages.
            run: the operation itself; it reports what it waits for in the :class:`Progress` it is given.

        Returns:
            A handle whose ``wait`` returns (or raises) what ``run`` did.
        """
        progress = Progress(operation)
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._failure is not None:
            future.set_exception(self._refusal(operation))
        else:
            self._queue.put((run, progress, future))
        return FutureHandle(future, progress, self)

    def _refusal(self, operation: str) -> UseAfterCloseError:
        return UseAfterCloseError(
            f"rank {self.rank}: {operation} refused: this communicator is unusable after an earlier failure: "
            f"{self._failure}"
        )

    def call(self, operation: str, run: Callable[[Progress], Any], timeout: float | None = None) -> Any:
        """Run ``run`` on the thread and wait for it: :meth:`submit`, then ``wait``.

        Args:
            operation: the operation, in words, for messages.
            run: the operation itself.
            timeout: seconds to wait at most; None waits the thread's timeout.

        Returns:
            What ``run`` returned.
        """
        handle = self.submit(operation, run)
        handle.wait(timeout)
        return handle._future.result()

    def fail(self, error: BaseException) -> None:
        """Mark the thread failed with ``error``: every later operation is refused, naming it.

        Args:
            error: the failure to report (the first one is kept).
        """
        if self._failure is None:
            self._failure = error

    @property
    def failure(self) -> BaseException | None:
        """The failure that made this thread unusable, or None."""
        return self._failure

    @property
    def running(self) -> Progress | None:
        """The operation this thread is running now (None when idle)."""
        return self._running

    def pending_description(self, progress: Progress) -> str:
        """What ``progress``'s operation still waits for, and what runs before it, for a timeout's message.

        Args:
            progress: a submitted operation's progress.

        Returns:
            The operation and its missing parts, in words.
        """
        running = self._running
        if running is not None and running is not progress:
            return f"an earlier operation ({running.operation}) still waiting for {running.describe()}"
        return progress.describe()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, progress, future = item
            if self._failure is not None:
                future.set_exception(self._refusal(progress.operation))
                continue
            self._running = progress
            try:
                future.set_result(run(progress))
            except BaseException as error:  # handed to the waiting thread, which re-raises it
                self.fail(error)
                future.set_exception(error)
            finally:
                self._running = None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after the operations already queued, waiting for it at most ``timeout``.

        Args:
            timeout: seconds to wait for the thread to end.
        """
        self._queue.put(None)
        self._thread.join(timeout)


class Communicator(abc.ABC):
    """The primitives every backend offers. See the module docstring for the exchange protocol."""

    backend: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    timeout: float

    def __init__(self) -> None:
        self._lifetime_traffic = Traffic()  # every exchange's payload bytes per peer, over its lifetime

    @property
    def bytes_sent(self) -> dict[int, int]:
        """Payload bytes sent to each peer by :meth:`exchange` since this communicator was created."""
        return self._lifetime_traffic.sent

    @property
    def bytes_received(self) -> dict[int, int]:
        """Payload bytes received from each peer by :meth:`exchange` since this communicator was created."""
        return self._lifetime_traffic.received

    # -- point to point -------------------------------------------------------------------------------------
    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        seq: int = 0,
        traffic: Traffic | None = None,
    ) -> Handle:
        """Start sending ``sends`` and receiving into ``recvs``; ``seq`` (e.g. the step) must match the peers'.

        The payload bytes per peer are added to this communicator's ``bytes_sent`` / ``bytes_received`` and, when
        given, to ``traffic`` (an algorithm's per-step account).

        Args:
            sends: ``(peer, tensor)`` for each contiguous tensor to send; must not change until the handle completes.
            recvs: ``(peer, tensor)`` for each contiguous tensor to receive into.
            seq: the exchange's sequence number; the peers must use the same.
            traffic: an account to add the payload bytes to, or None.

        Returns:
            A handle whose ``wait`` completes the exchange.
        """
        return self.start_planned(self.plan_exchange(sends, recvs), seq=seq, traffic=traffic)

    def plan_exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> PlannedExchange:
        """Check and number ``sends`` and ``recvs`` once, for :meth:`start_planned` to post at every step.

        What :meth:`exchange` does at each call: the peers, dtypes, contiguity and device are checked and the tensors
        numbered per peer.

        Args:
            sends: ``(peer, tensor)`` for each contiguous tensor to send.
            recvs: ``(peer, tensor)`` for each contiguous tensor to receive into.

        Returns:
            The plan, to pass to :meth:`start_planned`.
        """
        outgoing = plan_transfers(sends, "send to", self.rank, self.size, self.device)
        incoming = plan_transfers(recvs, "receive from", self.rank, self.size, self.device)
        totals: dict[int, list[int]] = {}
        for transfer in outgoing:
            totals.setdefault(transfer.peer, [0, 0])[0] += transfer.nbytes
        for transfer in incoming:
            totals.setdefault(transfer.peer, [0, 0])[1] += transfer.nbytes
        nbytes = tuple((peer, sent, received) for peer, (sent, received) in totals.items())
        return PlannedExchange(tuple(outgoing), tuple(incoming), nbytes)

    def start_planned(self, plan: PlannedExchange, *, seq: int = 0, traffic: Traffic | None = None) -> Handle:
        """Start the exchange ``plan`` describes (see :meth:`exchange`, :class:`PlannedExchange`).

        Args:
            plan: a plan from :meth:`plan_exchange`.
            seq: the exchange's sequence number; the peers must use the same.
            traffic: an account to add the payload bytes to, or None.

        Returns:
            A handle whose ``wait`` completes the exchange.
        """
        for ledger in (self._lifetime_traffic, traffic):
            if ledger is not None:
                for peer, sent, received in plan.nbytes:
                    ledger.record(peer, sent, received)
        return self._start_exchange(list(plan.sends), list(plan.recvs), seq)

    @abc.abstractmethod
    def _start_exchange(self, sends: list[Transfer], recvs: list[Transfer], seq: int) -> Handle: ...

    def closing_handshake(self, send_to: Sequence[int], receive_from: Sequence[int], steps: int) -> None:
        """Announce ``close()`` after ``steps`` optimizer steps to ``send_to`` and hear it from ``receive_from``.

        One header-checked message each way; returns once every peer announced the same. ``close()`` calls it with the
        peers the next exchange would use. A peer that took one more step than this rank is then inside that exchange:
        the two messages cross, and each end raises :class:`ExchangeMismatchError` naming the other's exchange and step
        count (:func:`closing_seq`), instead of both waiting out the timeout. Not counted in
        ``bytes_sent``/``bytes_received``: it carries no model.

        Args:
            send_to: the peers this rank would send to next.
            receive_from: the peers this rank would receive from next.
            steps: the optimizer steps this rank took.
        """
        token = torch.tensor([steps], dtype=torch.int64, device=self.device)
        sends = plan_transfers([(peer, token) for peer in send_to], "send to", self.rank, self.size, self.device)
        recvs = plan_transfers(
            [(peer, torch.empty_like(token)) for peer in receive_from], "receive from", self.rank, self.size,
            self.device,
        )  # fmt: skip
        self._start_exchange(sends, recvs, closing_seq(steps)).wait()

    # -- collectives ----------------------------------------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False, traffic: Traffic | None = None
    ) -> Handle | None:
        """Sum (or average) ``tensor`` over all ranks, in place.

        Args:
            tensor: a contiguous tensor on this communicator's device; holds the result afterwards.
            op: ``"sum"`` or ``"avg"`` (one of :data:`REDUCE_OPS`).
            async_op: return a handle instead of waiting.
            traffic: when given, records the bytes under :data:`COLLECTIVE` as a ring all-reduce moves them
                (:func:`ring_all_reduce_bytes`).

        Returns:
            A handle to wait on when ``async_op``, else None.

        Raises:
            InvalidArgumentError: ``op`` is not one of :data:`REDUCE_OPS`, or the tensor is not contiguous or on
                another device.
            ArgumentTypeError: ``"avg"`` of a tensor that is not floating-point, or a tensor of an unsupported dtype.
        """
        if op not in REDUCE_OPS:
            raise InvalidArgumentError(f"rank {self.rank}: all_reduce op {op!r} is not one of {REDUCE_OPS}")
        buffer = _check_tensor(tensor, f"rank {self.rank}: all_reduce tensor", self.device)
        if op == "avg" and not buffer.is_floating_point():
            raise ArgumentTypeError(
                f"rank {self.rank}: all_reduce 'avg' needs a floating-point tensor, got {buffer.dtype}"
            )
        if traffic is not None:
            nbytes = ring_all_reduce_bytes(buffer.numel() * buffer.element_size(), self.size)
            traffic.record(COLLECTIVE, nbytes, nbytes)
        handle = self._all_reduce(buffer, op)
        return handle if async_op else handle.wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Handle | None:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank.

        Args:
            tensor: a contiguous tensor on this communicator's device, of one shape and dtype on every rank.
            src: the rank whose tensor is copied.
            async_op: return a handle instead of waiting.

        Returns:
            A handle to wait on when ``async_op``, else None.

        Raises:
            InvalidArgumentError: ``src`` is not a rank in ``[0, size)``, or the tensor is not contiguous or on
                another device.
        """
        if not 0 <= src < self.size:
            raise InvalidArgumentError(f"rank {self.rank}: broadcast source {src} is not a rank in [0, {self.size})")
        handle = self._broadcast(_check_tensor(tensor, f"rank {self.rank}: broadcast tensor", self.device), src)
        return handle if async_op else handle.wait()

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle: ...

    @abc.abstractmethod
    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every rank arrives; on timeout name the ranks that did not (where the backend can tell).

        Args:
            timeout: seconds to wait at most; None waits the communicator's timeout.
        """

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order.

        Args:
            obj: a picklable object.

        Returns:
            One object per rank, index = rank.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend; safe to call twice."""

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: the communicator can no longer be used."""
        return bool(getattr(self, "_closed", False))

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, size={self.size}, "
            f"local_rank={self.local_rank}, local_size={self.local_size})"
        )
