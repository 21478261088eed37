"""A copy of the parameters on which PowerGossip runs a step's further power iterations during backward.

Every power iteration of step t is a function of the replicas x_t alone (the products, the differences, the
corrections): the update comes after backward, and the buckets must not be written between ``start`` and
``finish`` (autograd still reads the parameters). Iteration k + 1 multiplies the parameters *after* iteration k's
correction, so it cannot run on the parameters themselves before backward has ended. It can run on a copy:
:class:`Shadow` holds one buffer per bucket, filled from the buckets when the step's first iteration has arrived,
and each of PowerGossip's plans gets a twin (:func:`twin_plan`) whose products and updates are the same views of the
copy -- same shapes, strides and offsets, so the same kernels compute the same bits -- while its messages, factors
and difference buffers are the plan's own. ``finish`` completes the iterations on the copy and writes it back into
the buckets: the parameters end bit for bit as if every iteration had run on them in ``finish``
(:meth:`gossip.algorithms.powergossip.PowerGossip.progress`).
"""

from __future__ import annotations

import dataclasses

import torch

from gossip.algorithms.buckets import Bucket
from gossip.algorithms.powergossip_layout import Plan
from gossip.errors import InvalidArgumentError


class Shadow:
    """One buffer per bucket, laid out as the bucket's (same dtype, device, shape and strides).

    Args:
        buckets: the parameter buckets it copies.
    """

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self.buffers = [torch.empty_like(bucket.buffer) for bucket in buckets]

    def fill(self) -> None:
        """Copy the buckets into the buffers."""
        torch._foreach_copy_(self.buffers, [bucket.buffer for bucket in self.buckets])

    def write_back(self) -> None:
        """Copy the buffers into the buckets."""
        torch._foreach_copy_([bucket.buffer for bucket in self.buckets], self.buffers)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of the copy that ``tensor`` (a view of one bucket) is of the bucket.

        Args:
            tensor: a view of a bucket's buffer.

        Returns:
            The view of that bucket's copy with ``tensor``'s shape, strides and offset from the buffer's start.

        Raises:
            InvalidArgumentError: ``tensor`` is not a view of any bucket.
        """
        storage = tensor.untyped_storage().data_ptr()
        for bucket, copy in zip(self.buckets, self.buffers, strict=True):
            buffer = bucket.buffer
            if buffer.untyped_storage().data_ptr() == storage:
                offset = tensor.storage_offset() - buffer.storage_offset()
                return copy.as_strided(tensor.shape, tensor.stride(), copy.storage_offset() + offset)
        raise InvalidArgumentError("PowerGossip: a plan's view is of no parameter bucket (a bug: please report it)")


def twin_plan(plan: Plan, shadow: Shadow) -> Plan:
    """``plan`` with its products and updates on ``shadow``'s copy; the messages and factors are shared.

    Args:
        plan: a plan whose products and updates are views of the buckets.
        shadow: the copy.

    Returns:
        A plan that multiplies and updates the copy, with CUDA graphs of its own (they hold other tensors).
    """
    return dataclasses.replace(
        plan,
        products=[(factor, shadow.view(x), out) for factor, x, out in plan.products],
        updates=[(shadow.view(x), p, qt) for x, p, qt in plan.updates],
        graphs={},
    )
