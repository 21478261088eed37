"""Exact mixing over the replica axis: gossip of whole rows by index gathers, in the library's order of operations.

* :func:`exact_gossip_` is :class:`gossip.ExactGossip`'s ``_combine`` on every rank at once:
  :math:`x_i \\leftarrow (1 - \\gamma \\sum_j w_{ij}) x_i + \\gamma \\sum_j w_{ij} x_j`, the in-peers added one by
  one in the order the schedule lists them, each ``x_j`` gathered from the rows as they were before the step
  (``x[partner]``, a copy, so the received values are x_t as on the wire).
* :func:`rank_order_sum_` is the trackers' and the mean gradient's mixing
  (``gossip.wrapper.tracking.TrackerMixing``): :math:`\\sum_j W_{ij}(t) z_j` over this rank and its in-peers, summed in
  rank order from zero, so ranks whose rows of W(t) are equal get bit-identical results.
* :func:`consensus_sq` is :math:`\\Xi^2 = \\frac1n \\sum_i \\lVert x_i - \\bar x\\rVert^2` in float64.

A weight every rank shares is applied as a Python scalar (what the library does per rank); weights that differ
between ranks as an ``(n, 1)`` column rounded once to the rows' dtype, the value the library's scalar takes. Both
compute one product and one sum per element; whether the kernels fuse them (an FMA) can differ between the scalar
and the column form, which is rounding only (and nothing where the weights are powers of two, as the one-peer
schedules' 1/2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from experiments.scale.steps import StepPlan, Terms


def _add_scaled_(target: Tensor, source: Tensor, terms: Terms, scale: float) -> None:
    """target += scale * w * source, w the terms' weight of each row."""
    if terms.uniform is not None:
        target.add_(source, alpha=scale * terms.uniform)
    else:
        weights = torch.tensor(scale * terms.weights, dtype=torch.float64).to(target.dtype).to(target.device)
        target.addcmul_(weights.unsqueeze(1), source)


def exact_gossip_(rows: Tensor, plan: StepPlan, gamma: float = 1.0, columns: Sequence[slice] | None = None) -> None:
    """ExactGossip's mixing of ``rows`` (n, P) in place, on ``columns`` only when given (module docstring).

    Args:
        rows: the replicas' values, one row per rank.
        plan: W(t).
        gamma: the mixing step size.
        columns: slices of the columns to mix (PowerGossip's uncompressed tensors); None mixes all.
    """
    if not plan.slots:
        return
    parts = [rows] if columns is None else [rows[:, c] for c in columns]
    keep = 1.0 - gamma * plan.peer_sums
    for part in parts:
        received = [part[slot.index] for slot in plan.slots]  # gathered before any row changes
        if (keep == keep[0]).all():
            part.mul_(float(keep[0]))
        else:
            part.mul_(torch.tensor(keep, dtype=torch.float64).to(part.dtype).to(part.device).unsqueeze(1))
        for slot, values in zip(plan.slots, received, strict=True):
            _add_scaled_(part, values, slot, gamma)


def rank_order_sum_(rows: Tensor, plan: StepPlan, scratch: Tensor | None = None) -> None:
    """The trackers' mixing of ``rows`` (n, P) in place: each rank's terms summed in rank order from zero.

    Args:
        rows: the values z, one row per rank.
        plan: W(t).
        scratch: a buffer like ``rows`` for the sums (allocated when None).
    """
    if not plan.slots:
        return
    total = torch.zeros_like(rows) if scratch is None else scratch.zero_()
    identity = torch.arange(plan.n, device=rows.device)
    for terms in plan.ordered:
        source = rows if torch.equal(terms.index, identity) else rows[terms.index]
        _add_scaled_(total, source, terms, 1.0)
    rows.copy_(total)


def mean_in_rank_order(rows: Tensor) -> Tensor:
    """The mean of the rows as the simulator's all-reduce forms it: summed in rank order, then divided by n.

    Args:
        rows: (n, P) values.

    Returns:
        A (1, P) tensor.
    """
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return (total / rows.shape[0]).unsqueeze(0)


@torch.no_grad()
def consensus_sq(rows: Tensor, block: int = 1 << 16) -> float:
    """:math:`\\Xi^2`, the mean squared distance of the rows to their mean, in float64, a block of columns at a time.

    Args:
        rows: (n, P) replicas.
        block: columns per block (bounds the float64 copy).

    Returns:
        The value.
    """
    total = 0.0
    for start in range(0, rows.shape[1], block):
        part = rows[:, start : start + block].double()
        total += float((part - part.mean(dim=0, keepdim=True)).square().sum())
    return total / rows.shape[0]
