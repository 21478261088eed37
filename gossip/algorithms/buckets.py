"""Flat parameter buckets: each step sends a few large contiguous messages instead of one per tensor.

A :class:`Bucket` is one contiguous buffer of one dtype and device, holding several tensors back to back; each
tensor is a view ``buffer[offset:offset + numel].view(shape)``. :func:`bucket_parameters` moves a module's
parameters into buckets so that the parameters *become* those views (``param.data`` is rebound; autograd and
optimizers are unaffected), which lets the algorithms mix the whole model with a few flat operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """Where one named tensor lives inside its bucket.

    Attributes:
        name: the parameter's name (as ``named_parameters`` gives it).
        offset: its first element's index in the bucket's flat buffer.
        shape: its shape.
    """

    name: str
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        """The number of elements of the tensor."""
        return self.shape.numel()


@dataclass
class Bucket:
    """Named tensors of one dtype and device laid out back to back in one flat buffer.

    Attributes:
        buffer: the flat, contiguous buffer.
        entries: where each tensor lives in it, in order.
    """

    buffer: torch.Tensor
    entries: list[Entry]

    def view(self, entry: Entry, source: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor of ``entry`` inside ``source`` (a buffer laid out like this bucket's), default the bucket.

        Args:
            entry: one of this bucket's entries.
            source: a flat buffer laid out like this bucket's; None is the bucket's own buffer.

        Returns:
            A view of ``entry``'s elements, shaped as the tensor.
        """
        source = self.buffer if source is None else source
        return source[entry.offset : entry.offset + entry.numel].view(entry.shape)

    @property
    def nbytes(self) -> int:
        """The bytes of the bucket's buffer."""
        return self.buffer.numel() * self.buffer.element_size()


def gradients_into(
    buckets: Sequence[Bucket], parameters: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
) -> dict[torch.Tensor, torch.Tensor]:
    """Copy each parameter's ``.grad`` into ``targets``, zeros for a parameter without one.

    Args:
        buckets: the parameters' buckets.
        parameters: the parameters, in the order of the buckets' entries.
        targets: one flat buffer per bucket, laid out like it (see :meth:`Bucket.view`).

    Returns:
        The views of ``targets`` holding the gradients, keyed by the parameters that have one.
    """
    views, position = {}, 0
    for bucket, target in zip(buckets, targets, strict=True):
        for entry in bucket.entries:
            parameter = parameters[position]
            position += 1
            view = bucket.view(entry, target)
            if parameter.grad is None:
                view.zero_()
            else:
                view.copy_(parameter.grad)
                views[parameter] = view
    return views


def _groups(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of the same dtype and device, cut when a bucket would exceed ``bucket_bytes``."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        last = groups[-1][-1][1] if groups else None
        if (
            last is None
            or (last.dtype, last.device) != (tensor.dtype, tensor.device)
            or (size + nbytes > bucket_bytes and size > 0)
        ):
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += nbytes
    return groups


def pack(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Copy ``named`` tensors into new buckets (the tensors themselves are left alone).

    Args:
        named: ``(name, tensor)`` pairs, in order.
        bucket_bytes: the size a bucket fills up to before the next one starts (default
            :data:`DEFAULT_BUCKET_BYTES`).

    Returns:
        The buckets, holding copies of the tensors.
    """
    buckets = []
    for group in _groups(list(named), bucket_bytes):
        entries, offset = [], 0
        for name, tensor in group:
            entries.append(Entry(name, offset, tensor.shape))
            offset += tensor.numel()
        first = group[0][1]
        buffer = torch.empty(offset, dtype=first.dtype, device=first.device)
        bucket = Bucket(buffer, entries)
        for entry, (_, tensor) in zip(entries, group, strict=True):
            bucket.view(entry).copy_(tensor.detach())
        buckets.append(bucket)
    return buckets


def bucket_parameters(module: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Move ``module``'s trainable parameters into buckets; afterwards every parameter is a view of a bucket.

    Args:
        module: the model; its parameters with ``requires_grad`` are moved.
        bucket_bytes: the size a bucket fills up to before the next one starts (default
            :data:`DEFAULT_BUCKET_BYTES`).

    Returns:
        The buckets, which the parameters now view.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    buckets = pack(named, bucket_bytes)
    params = dict(named)
    for bucket in buckets:
        for entry in bucket.entries:
            params[entry.name].data = bucket.view(entry)
    return buckets
