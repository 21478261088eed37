"""Exact (uncompressed) gossip: x_i <- x_i + gamma * sum_j W_ij(t) (x_j - x_i)  (docs/design.md A.1, F).

With gamma = 1 this is plain mixing x_i <- sum_j W_ij x_j; gamma > 1 is over-relaxation (gamma* = 1.3084 on the
uniform 8-ring, F.3). Every bucket is sent whole to every out-peer and received from every in-peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gossip.algorithms.base import Algorithm, check_nonfinite_policy
from gossip.backends.comm_thread import Handle
from gossip.errors import InvalidArgumentError
from topologies import PeerView


@dataclass
class _Pending:
    step: int
    view: PeerView
    handle: Handle
    received: list[list[torch.Tensor]]  # per in-peer, per bucket


class ExactGossip(Algorithm):
    """Uncompressed gossip of the full parameters over the schedule's edges.

    Args:
        gamma: the step size of the mixing, x_i <- x_i + gamma sum_j w_ij (x_j - x_i).
        nonfinite: what a NaN or Inf received from a peer does: ``"raise"`` or ``"drop"``.

    Raises:
        InvalidArgumentError: ``gamma`` is not positive, or ``nonfinite`` is not a known policy.
    """

    name = "exact"
    state_dict_is_snapshot = True  # no state

    def __init__(self, gamma: float = 1.0, *, nonfinite: str = "raise"):
        if not gamma > 0:
            raise InvalidArgumentError(f"ExactGossip: gamma must be positive, got {gamma}")
        self.gamma = float(gamma)
        self._nonfinite = check_nonfinite_policy("ExactGossip", nonfinite)
        self._receive_buffers: list[list[torch.Tensor]] = []

    @property
    def nonfinite(self) -> str:
        """What a NaN or Inf received from a peer does: "raise" or "drop" (see the module docstring)."""
        return self._nonfinite

    def _buffers(self, count: int) -> list[list[torch.Tensor]]:
        while len(self._receive_buffers) < count:
            self._receive_buffers.append([torch.empty_like(bucket.buffer) for bucket in self.buckets])
        return self._receive_buffers[:count]

    def _outgoing(self) -> list[torch.Tensor]:
        """What this rank sends of each bucket: the bucket's buffer itself."""
        return [bucket.buffer for bucket in self.buckets]

    def _start_step(self, step: int) -> _Pending:
        view = self.schedule.peers(self.comm.rank, step)
        received = self._buffers(len(view.in_peers))
        outgoing = self._outgoing()
        sends = [(peer, message) for peer, _ in view.out_peers for message in outgoing]
        recvs = [
            (peer, buffer) for (peer, _), buffers in zip(view.in_peers, received, strict=True) for buffer in buffers
        ]
        return _Pending(step, view, self._exchange(sends, recvs, step), received)

    def _finish_step(self, pending: _Pending) -> None:
        self._wait(pending.handle)
        received = [(peer, buffers) for (peer, _), buffers in zip(pending.view.in_peers, pending.received, strict=True)]
        dropped = self._nonfinite_peers(pending.step, self._nonfinite, received)
        self._combine(
            [
                (peer, weight, buffers)
                for (peer, weight), buffers in zip(pending.view.in_peers, pending.received, strict=True)
                if peer not in dropped
            ]
        )

    def _combine(self, kept: list[tuple[int, float, list[torch.Tensor]]]) -> None:
        """x_i <- (1 - gamma sum_j w_ij) x_i + gamma sum_j w_ij x_j over the ``kept`` (peer, weight, buffers)."""
        gamma = self.gamma
        keep = 1.0 - gamma * sum(weight for _, weight, _ in kept)
        for index, bucket in enumerate(self.buckets):
            bucket.buffer.mul_(keep)
            for _, weight, buffers in kept:
                bucket.buffer.add_(buffers[index], alpha=gamma * weight)
