"""The wire protocol of ``Communicator.exchange``: the header in front of every tensor and its checks.

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

Closing. ``DecentralizedDataParallel.close()`` ends with ``Communicator.closing_handshake``: one message to and from the
peers of the exchange that would come next, numbered :func:`closing_seq` (below :data:`CLOSING`, never an exchange's
number). A rank that took one more optimizer step than its peers is inside that very exchange, so the two messages cross
and the header checks name it on both ends, at once, instead of a timeout."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gossip.errors import (
    ExchangeMismatchError,
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
DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPE_CODES.items()}
STEADY = -1  # the index field of a steady header: one per peer, announcing tensors already checked
#: Sequence numbers at or below this one announce a rank in ``close()`` (:func:`closing_seq`), not an exchange.
CLOSING = -2


def closing_seq(steps: int) -> int:
    """The sequence number of ``Communicator.closing_handshake`` after ``steps`` optimizer steps.

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
    return f"{DTYPE_NAMES.get(code, f'dtype code {code}')}[{numel}]"


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
