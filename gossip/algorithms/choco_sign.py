r"""CHOCO-Gossip with scaled-sign messages on a time-varying symmetric schedule: full-rank compression with error
feedback, meant for gradient trackers (Koloskova, Stich & Jaggi, ICML 2019, "Decentralized Stochastic Optimization
and Gossip Algorithms with Compressed Communication", Algorithm 1; the codes: :mod:`gossip.algorithms.scaled_sign`).

For each neighbour j it has met, rank i keeps two public copies of every bucket: :math:`\hat x_{i|j}`, its own
buffer as j knows it, and :math:`\hat x_{j|i}`, j's as i knows it (both start at 0). At a step where
:math:`W_{ij}(t) > 0`, i sends :math:`q_{i \to j} = C(x_i - \hat x_{i|j})`, C the scaled-sign code; both ends add
each message to their copy of its sender's public buffer, so the two ends of an edge hold bit-identical copies, and

.. math::  x_i \leftarrow x_i + \gamma \sum_j W_{ij}(t) (\hat x_{j|i} - \hat x_{i|j}).

On a symmetric W an edge's two corrections are equal and opposite, so :math:`\sum_i x_i` is preserved (the
invariant gradient tracking needs). What a message leaves out of a residual stays in it for the edge's next meeting
(error feedback). Unlike a rank-r projection, which removes about r/d of a d-dimensional residual's energy, a
one-level sign message removes 2/π of the energy of independent Gaussian entries whatever their rank: the code for
trackers, whose increments are full-rank noise.

Cost per edge and step: :math:`(1 + \log_2 L)` bits a value plus L float32 scales per chunk of C values (L =
``levels``); with the defaults (L = 4, C = 256), 3/32 + 1/64 of the float32 model. Memory: two copies of the
buffers per neighbour met (the one-peer hypercube meets log2 n of them).

Non-finite input: a NaN or Inf in a received message's scales (where a NaN or Inf of the sender's residual lands)
raises :class:`gossip.errors.NonFiniteError` naming the rank, step and peer, a step later on a GPU like every
algorithm's check (:mod:`gossip.algorithms.base`). There is no ``"drop"``: both ends of an edge must apply the same
messages, or their copies part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.scaled_sign import SignCodec, check_levels
from gossip.backends.comm_thread import Handle
from gossip.errors import CheckpointMismatchError, InvalidArgumentError

__all__ = ["ChocoSign"]

Message = tuple[torch.Tensor, ...]


@dataclass
class _Slot:
    """The kept buffers of one edge's exchange, per bucket: what the message sent decodes to (written by the
    encode), and the message being received (its parts' shapes are fixed by the bucket's size). Taken by a step's
    start, given back by its finish, so that a step allocates only the messages it sends."""

    layout: list[int]  # the buckets' sizes the buffers were made for
    values: list[torch.Tensor]
    incoming: list[Message]


@dataclass
class _Edge:
    """One step's exchange with one peer: its weight, the messages sent and what they decode to, and the messages
    being received, per bucket."""

    peer: int
    weight: float
    outgoing: list[Message]
    sent: list[torch.Tensor]
    incoming: list[Message]
    slot: _Slot


@dataclass
class _Pending:
    step: int
    edges: list[_Edge]
    handle: Handle


class ChocoSign(Algorithm):
    """CHOCO-Gossip with scaled-sign messages and public copies kept per edge (module docstring).

    ``DecentralizedDataParallel(..., gradient_tracking=ChocoSign())`` (or ``gradient_tracking="sign"``) mixes the
    trackers with it; it can mix the parameters too.

    Args:
        gamma: the consensus step size γ.
        chunk: values per scale, a positive multiple of 8.
        levels: magnitudes per chunk: 1 (1 bit a value), 2 (2 bits, two scales) or 4 (3 bits, four scales).

    Raises:
        InvalidArgumentError: ``gamma`` is not positive, ``chunk`` is not a positive multiple of 8, or ``levels``
            is not 1, 2 or 4.
    """

    name = "choco-sign"
    needs_symmetric_schedule = True
    state_dict_is_snapshot = True  # copies of the public buffers
    start_keeps_state = True  # only finish adds the messages to the copies

    def __init__(self, gamma: float = 1.0, chunk: int = 256, levels: int = 4):
        if not gamma > 0:
            raise InvalidArgumentError(f"ChocoSign: gamma must be positive, got {gamma}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 8 or chunk % 8:
            raise InvalidArgumentError(f"ChocoSign: chunk must be a positive multiple of 8, got {chunk!r}")
        self.gamma, self.chunk, self.levels = float(gamma), chunk, check_levels("ChocoSign", levels)
        #: peer -> (this rank's buffers as the peer knows them, the peer's as this rank knows them), per bucket
        self.public: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._codecs: list[SignCodec] = []  # per bucket: one codec, shared, whose work buffers hold one block
        self._scratch: list[torch.Tensor] = []  # one per bucket: a residual being coded, or a correction
        self._slots: list[_Slot] = []  # kept buffers of edges not in flight (_Slot)

    def describe(self) -> dict[str, list[str]]:
        """Every tensor travels as a scaled-sign message.

        Returns:
            ``{"compressed": names, "exact": []}``.
        """
        return {"compressed": [entry.name for bucket in self.buckets for entry in bucket.entries], "exact": []}

    def _copies(self, peer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(this rank's buffers as ``peer`` knows them, ``peer``'s as this rank knows them), created at 0."""
        if peer not in self.public:
            self.public[peer] = tuple([torch.zeros_like(b.buffer) for b in self.buckets] for _ in range(2))
        return self.public[peer]

    def _work(self) -> tuple[list[SignCodec], list[torch.Tensor]]:
        """The buckets' codecs and scratch buffers, made at the first step and again if the buckets change."""
        layout = [(b.buffer.shape, b.buffer.dtype, b.buffer.device) for b in self.buckets]
        if [(t.shape, t.dtype, t.device) for t in self._scratch] != layout:
            codec = SignCodec(self.chunk, self.levels)  # one for every bucket: its buffers hold one block
            self._codecs = [codec] * len(self.buckets)
            self._scratch = [torch.empty_like(b.buffer) for b in self.buckets]
            self._slots = []
        return self._codecs, self._scratch

    def _slot(self, codecs: list[SignCodec]) -> _Slot:
        """A free edge's buffers, made (the receive buffers empty until the first message is coded) if none is."""
        if self._slots:
            return self._slots.pop()
        layout = [b.buffer.numel() for b in self.buckets]
        pairs = zip(codecs, self.buckets, strict=True)
        values = [codec.values_buffer(b.buffer.numel(), b.buffer.device) for codec, b in pairs]
        return _Slot(layout, values, [])

    def _start_step(self, step: int) -> _Pending:
        edges, sends, recvs = [], [], []
        codecs, scratch = self._work()
        for peer, weight in self.schedule.peers(self.comm.rank, step).in_peers:
            mine, _ = self._copies(peer)
            slot = self._slot(codecs)
            codes = [
                codec.encode(torch.sub(b.buffer, m, out=residual), out=out)
                for codec, residual, b, m, out in zip(codecs, scratch, self.buckets, mine, slot.values, strict=True)
            ]
            outgoing = [message for message, _ in codes]
            if [[p.shape for p in m] for m in slot.incoming] != [[p.shape for p in m] for m in outgoing]:
                slot.incoming = [tuple(torch.empty_like(part) for part in message) for message in outgoing]
            for message, reply in zip(outgoing, slot.incoming, strict=True):
                sends += [(peer, part) for part in message]
                recvs += [(peer, part) for part in reply]
            edges.append(_Edge(peer, weight, outgoing, [values for _, values in codes], slot.incoming, slot))
        return _Pending(step, edges, self._exchange(sends, recvs, step))

    def _finish_step(self, pending: _Pending) -> None:
        self._wait(pending.handle)
        # a message's only floats are its scales; a NaN or Inf in the residual reaches them
        self._nonfinite_peers(pending.step, "raise", [(e.peer, [m[1] for m in e.incoming]) for e in pending.edges])
        codecs, scratch = self._work()
        for edge in pending.edges:
            mine, theirs = self._copies(edge.peer)
            for index, bucket in enumerate(self.buckets):
                mine[index].add_(edge.sent[index])
                codecs[index].decode_add_(edge.incoming[index], bucket.buffer.numel(), theirs[index])
                correction = torch.sub(theirs[index], mine[index], out=scratch[index])
                bucket.buffer.add_(correction, alpha=self.gamma * edge.weight)
            if edge.slot.layout == [b.buffer.numel() for b in self.buckets]:
                self._slots.append(edge.slot)  # free for a later step's edge

    def _nonfinite_remedy(self) -> str:
        return "ChocoSign has no 'drop': both ends of an edge must apply the same messages"

    def state_dict(self) -> dict[str, Any]:
        """Copies of the public buffers of every edge met so far.

        Returns:
            ``{"public": {peer: {"mine": [...], "theirs": [...]}}}``, one tensor per bucket each.
        """
        return {
            "public": {
                peer: {"mine": [t.clone() for t in mine], "theirs": [t.clone() for t in theirs]}
                for peer, (mine, theirs) in self.public.items()
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: the saved public buffers.

        Raises:
            CheckpointMismatchError: a saved buffer does not have this run's bucket layout.
        """
        layout = [(b.buffer.shape, b.buffer.dtype) for b in self.buckets]
        device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
        public = {}
        for peer, copies in state.get("public", {}).items():
            sides = [[t.to(device, copy=True) for t in copies[side]] for side in ("mine", "theirs")]
            if any([(t.shape, t.dtype) for t in side] != layout for side in sides):
                raise CheckpointMismatchError(
                    f"rank {self.comm.rank}: the saved ChocoSign copies of the edge to peer {peer} do not have this "
                    "run's bucket layout"
                )
            public[int(peer)] = (sides[0], sides[1])
        self.public = public
