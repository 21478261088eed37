r"""Consensus distance, exact and sampled, and the global average used for evaluation (docs/design.md F.4).

The squared consensus distance of n replicas x_i (Kong et al. 2021) is

.. math::  \Xi^2 = \frac{1}{n} \sum_i \lVert x_i - \bar x \rVert^2,  \qquad \bar x = \frac{1}{n} \sum_i x_i .

* :func:`exact_consensus_sq` (F.4 method 1) all-reduces x_i in float64 to get :math:`\bar x`, then averages
  :math:`\lVert x_i - \bar x \rVert^2` over ranks -- not :math:`\mathrm{mean}\lVert x_i\rVert^2 - \lVert\bar x\rVert^2`,
  which cancels catastrophically when the replicas are close.
* :class:`ConsensusSampler` (F.4 method 2, stratified by layer) estimates it every step for the price of one small
  all-reduce: every rank draws the same coordinates from a generator seeded by (seed, step), s_k of them in tensor
  k, with s_k proportional to the tensor's size (with a floor, see :func:`allocate_samples`). Per sampled
  coordinate c the all-reduced sums
  :math:`\sum_i v_{ic}` and :math:`\sum_i v_{ic}^2` (float64) give the spread
  :math:`\frac1n\sum_i v_{ic}^2 - \bar v_c^2`; tensor k contributes the mean spread over its s_k coordinates times
  its size. The estimate is unbiased (sampling with replacement) and exact when s_k >= numel_k (all coordinates
  are then taken once). Its accuracy is measured in docs/results.md, section "Consensus-distance estimate".
* :func:`global_average` computes the global average of the parameters into new tensors, and :func:`reading` lets
  the parameters read it for an evaluation without writing their own memory (nothing to restore afterwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from gossip.backends.base import Communicator
from gossip.errors import InvalidArgumentError

DEFAULT_SAMPLES = 16384
_SEED_STRIDE = 1_000_003


def exact_consensus_sq(tensors: Sequence[torch.Tensor], comm: Communicator) -> float:
    r""":math:`\Xi^2` over ``tensors`` (e.g. the flat buckets); a collective: every rank must call it.

    Args:
        tensors: this rank's replica x_i, as tensors of the same sizes on every rank.
        comm: the communicator of the replicas.

    Returns:
        :math:`\Xi^2`, the same on every rank.
    """
    local_sq = torch.zeros(1, dtype=torch.float64)
    for tensor in tensors:
        local = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        mean = local.clone()
        _all_reduce_on(comm, mean, "avg")
        local_sq += (local - mean).square().sum()
    _all_reduce_on(comm, local_sq, "avg")
    return float(local_sq.item())


def _all_reduce_on(comm: Communicator, cpu_tensor: torch.Tensor, op: str = "avg") -> None:
    """All-reduce a CPU float64 tensor on the communicator's device and copy the result back."""
    if comm.device.type == "cpu":
        comm.all_reduce(cpu_tensor, op)
        return
    on_device = cpu_tensor.to(comm.device)
    comm.all_reduce(on_device, op)
    cpu_tensor.copy_(on_device.cpu())


def allocate_samples(sizes: Sequence[int], samples: int) -> list[int]:
    """Coordinates drawn per tensor: proportional to its size, at most all of it, and at least a floor.

    The floor is ``samples // (4 * len(sizes))`` (at least 1), so small tensors (biases, norms), whose spread can
    dominate, are not estimated from one or two coordinates. The total exceeds ``samples`` by at most a quarter.

    Args:
        sizes: the number of elements of each tensor.
        samples: the number of coordinates to spread over them (at least 1).

    Returns:
        The number of coordinates drawn in each tensor.

    Raises:
        InvalidArgumentError: ``samples`` is below 1.
    """
    if samples < 1:
        raise InvalidArgumentError(f"consensus sampling needs at least 1 coordinate, got samples={samples}")
    total = sum(sizes)
    if samples >= total:
        return list(sizes)
    floor = max(1, samples // (4 * len(sizes)))
    return [min(size, max(floor, round(samples * size / total))) for size in sizes]


class ConsensusSampler:
    r"""Shared-coordinate estimate of :math:`\Xi^2`, stratified by tensor (see the module docstring).

    Args:
        sizes: the number of elements of each tensor the estimate covers.
        samples: the number of coordinates sampled per estimate (see :func:`allocate_samples`).
        seed: with the step, seeds the generator that picks the coordinates (equal on every rank).
    """

    def __init__(self, sizes: Sequence[int], samples: int = DEFAULT_SAMPLES, seed: int = 0):
        self.sizes = [int(s) for s in sizes]
        self.counts = allocate_samples(self.sizes, samples)
        self.seed = int(seed)

    def _indices(self, step: int) -> list[torch.Tensor | None]:
        generator = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + int(step))
        return [
            None if count >= size else torch.randint(size, (count,), generator=generator)
            for size, count in zip(self.sizes, self.counts, strict=True)
        ]

    def estimate_sq(self, tensors: Sequence[torch.Tensor], comm: Communicator, step: int) -> float:
        r"""Estimate :math:`\Xi^2` at ``step``; a collective (one all-reduce of ``2 * s`` float64 values).

        Args:
            tensors: this rank's replica, tensors of the sizes given at construction.
            comm: the communicator of the replicas.
            step: picks the coordinates (every rank passes the same).

        Returns:
            The estimate of :math:`\Xi^2`, the same on every rank.

        Raises:
            InvalidArgumentError: ``tensors`` do not have the sizes given at construction.
        """
        if [t.numel() for t in tensors] != self.sizes:
            raise InvalidArgumentError(
                f"ConsensusSampler was built for tensor sizes {self.sizes}, got a different model"
            )
        values = []
        for tensor, indices in zip(tensors, self._indices(step), strict=True):
            flat = tensor.detach().reshape(-1)
            picked = flat if indices is None else flat[indices.to(flat.device)]
            values.append(picked.to(device="cpu", dtype=torch.float64))
        sampled = torch.cat(values)
        sums = torch.cat([sampled, sampled.square()])
        _all_reduce_on(comm, sums, "sum")
        m, n = sampled.numel(), comm.size
        mean = sums[:m] / n
        spread = (sums[m:] / n - mean.square()).clamp_min_(0.0)
        total, offset = 0.0, 0
        for size, count in zip(self.sizes, self.counts, strict=True):
            total += float(spread[offset : offset + count].sum()) * size / count
            offset += count
        return total


def global_average(tensors: Sequence[torch.Tensor], comm: Communicator) -> list[torch.Tensor]:
    """The average over ranks of each of ``tensors``, in new tensors; ``tensors`` are only read. A collective.

    One clone per tensor, then an in-place ``all_reduce(..., "avg")`` of the clone: the same arithmetic, so the
    same bits, as averaging the tensor itself.

    Args:
        tensors: this rank's tensors (the same shapes on every rank).
        comm: the communicator of the replicas.

    Returns:
        The averages, one new tensor per tensor.
    """
    averages = []
    for tensor in tensors:
        average = tensor.detach().clone()
        comm.all_reduce(average, "avg")
        averages.append(average)
    return averages


@contextlib.contextmanager
def reading(tensors: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within the block each of ``tensors`` reads the matching one of ``values``; afterwards its own memory again.

    ``tensor.data = value`` for the block, and the tensor's own storage back on exit (the way
    :func:`gossip.algorithms.buckets.bucket_parameters` makes parameters views of a bucket): the tensors' memory is
    neither copied nor written, so restoring costs nothing and is exact. What is written into a tensor inside the block
    lands in ``value``.

    Args:
        tensors: the tensors (e.g. parameters) that read other values within the block.
        values: one tensor of the same shape and dtype per tensor.

    Yields:
        Nothing; the block runs with the tensors reading ``values``.

    Raises:
        InvalidArgumentError: the counts, shapes or dtypes of ``tensors`` and ``values`` differ.
    """
    if len(tensors) != len(values):
        raise InvalidArgumentError(f"reading: {len(tensors)} tensors but {len(values)} values")
    for tensor, value in zip(tensors, values, strict=True):
        if value.shape != tensor.shape or value.dtype != tensor.dtype or value.device != tensor.device:
            raise InvalidArgumentError(
                f"reading: a value of {value.dtype}{list(value.shape)} on {value.device} cannot stand in for a "
                f"tensor of {tensor.dtype}{list(tensor.shape)} on {tensor.device}"
            )
    own = [tensor.data for tensor in tensors]
    try:
        for tensor, value in zip(tensors, values, strict=True):
            tensor.data = value
        yield
    finally:
        for tensor, storage in zip(tensors, own, strict=True):
            tensor.data = storage
