"""All-Reduce baseline behind the gossip interface: exact global averaging, x_i <- x_i + gamma (xbar - x_i).

The average is computed on a copy, so the parameters stay readable by forward and backward while the
all-reduce runs. Bytes are accounted as a ring all-reduce moves them: 2 (n-1)/n * M sent and received per rank
(per bucket, rounded to a byte: :func:`gossip.backends.base.ring_all_reduce_bytes`).
The torch DDP baseline of the experiments averages gradients instead; this one mixes parameters, i.e. gossip
on the complete graph, which is what a schedule-free comparison inside the same loop needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gossip.algorithms.base import COLLECTIVE, Algorithm
from gossip.backends.comm_thread import Handle
from gossip.errors import InvalidArgumentError

__all__ = ["COLLECTIVE", "AllReduce"]


@dataclass
class _Pending:
    copies: list[torch.Tensor]
    handles: list[Handle]


class AllReduce(Algorithm):
    """Global averaging of the parameters every step (needs no schedule).

    Args:
        gamma: the step size in x_i <- x_i + gamma (xbar - x_i); 1 is the exact average.

    Raises:
        InvalidArgumentError: ``gamma`` is not in (0, 1].
    """

    name = "allreduce"
    state_dict_is_snapshot = True  # no state

    def __init__(self, gamma: float = 1.0):
        if not 0 < gamma <= 1:
            raise InvalidArgumentError(f"AllReduce: gamma must be in (0, 1], got {gamma}")
        self.gamma = float(gamma)

    def _start_step(self, step: int) -> _Pending:
        copies = [bucket.buffer.clone() for bucket in self.buckets]
        return _Pending(copies, [self._all_reduce(copy) for copy in copies])

    def _finish_step(self, pending: _Pending) -> None:
        for bucket, copy, handle in zip(self.buckets, pending.copies, pending.handles, strict=True):
            self._wait(handle)
            if self.gamma == 1.0:
                bucket.buffer.copy_(copy)
            else:
                bucket.buffer.lerp_(copy, self.gamma)
