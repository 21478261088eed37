"""The communicator interface every backend implements, and the pieces they share.

A communicator offers a handful of primitives with identical semantics on every backend:

* ``rank``, ``size``, ``local_rank``, ``local_size``;
* ``exchange(sends, recvs, seq=...)``: in one non-blocking call, send these contiguous tensors to these peers and
  receive into those tensors from those peers; returns a :class:`~gossip.backends.comm_thread.Handle` whose
  ``wait(timeout)`` completes it;
* ``plan_exchange(sends, recvs)`` and ``start_planned(plan, seq=...)``: the same exchange split in two, for
  buffers an algorithm sends and receives into at every step: the tensors are checked and numbered once, and each
  step only posts them (:class:`PlannedExchange`);
* ``all_reduce`` (sum or average, in place), ``broadcast``, ``barrier``, ``all_gather_object``, ``close``.

The wire protocol (checked headers, steady headers, the closing handshake's numbering) is
:mod:`gossip.backends.wire`; the thread that runs every operation of a communicator in order is
:mod:`gossip.backends.comm_thread`.

Send buffers must not be modified until the handle's ``wait`` returns. Receive buffers hold the peer's data
when ``wait`` returns.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from gossip.backends.comm_thread import Handle
from gossip.backends.wire import DTYPE_CODES, DTYPE_NAMES, Transfer, closing_seq
from gossip.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
)

REDUCE_OPS = ("sum", "avg")


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
        raise ArgumentTypeError(f"{what} has dtype {tensor.dtype}; supported: {', '.join(DTYPE_NAMES.values())}")
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


class Communicator(abc.ABC):
    """The primitives every backend offers. See the module docstring for the exchange protocol.

    Attributes:
        ranks_share_a_process: the ranks are threads of one process sharing its devices (the simulator), so a
            rank cannot capture CUDA graphs (a capture in one thread is invalidated by another's device
            synchronisation, such as a cudaFree).
    """

    ranks_share_a_process: bool = False
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
        count (:func:`~gossip.backends.wire.closing_seq`), instead of both waiting out the timeout. Not counted in
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
        self,
        tensor: torch.Tensor,
        op: str = "sum",
        *,
        async_op: bool = False,
        traffic: Traffic | None = None,
        in_step: bool = False,
    ) -> Handle | None:
        """Sum (or average) ``tensor`` over all ranks, in place.

        Args:
            tensor: a contiguous tensor on this communicator's device; holds the result afterwards.
            op: ``"sum"`` or ``"avg"`` (one of :data:`REDUCE_OPS`).
            async_op: return a handle instead of waiting.
            traffic: when given, records the bytes under :data:`COLLECTIVE` as a ring all-reduce moves them
                (:func:`ring_all_reduce_bytes`).
            in_step: the collective is part of a training step's update, posted like the step's exchanges (an
                elastic communicator posts it only while no change is under way, and counts it among the
                step's exchanges); the same as any all-reduce otherwise.

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
        handle = self._start_step_all_reduce(buffer, op) if in_step else self._all_reduce(buffer, op)
        return handle if async_op else handle.wait()

    def _start_step_all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        """Start an all-reduce that is part of a training step (:meth:`all_reduce` with ``in_step``)."""
        return self._all_reduce(tensor, op)

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
