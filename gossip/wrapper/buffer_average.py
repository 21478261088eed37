r"""``buffers="average"``: the floating-point buffers replaced by their average over the ranks at every step.

BatchNorm's running statistics and the like are not parameters, so gossip never mixes them; with this policy the
wrapper all-reduces them (blocking, right after the parameters' mixing) so that every rank's module holds
:math:`\bar b = \frac1n \sum_i b_i`. Integer buffers (``num_batches_tracked``) stay local. The algorithm's
non-finite policy applies to the buffers as to the parameters.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from gossip.algorithms.buckets import Bucket, pack
from gossip.backends.base import Communicator
from gossip.errors import NonFiniteError, NonFiniteWarning


def float_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's floating-point buffers, by name, in ``named_buffers()`` order.

    Args:
        module: the model.

    Returns:
        ``(name, buffer)`` for every floating-point buffer.
    """
    return [(name, b) for name, b in module.named_buffers() if b.is_floating_point()]


def average_buffers(module: nn.Module, comm: Communicator, nonfinite: str, step: int) -> None:
    """Replace the floating-point buffers of ``module`` by their average over ranks. A collective.

    A rank whose buffer holds NaN or Inf would spread it to every rank, so with ``nonfinite="raise"`` every rank
    raises :class:`NonFiniteError` naming the rank(s) and the buffer, and with ``"drop"`` the average is taken over
    the finite ranks only (a :class:`NonFiniteWarning` names the dropped ranks; they receive the finite ranks'
    average). The check costs one ``isfinite`` of the averaged result; only when it fails are the ranks asked which
    one it was.

    Args:
        module: this rank's replica.
        comm: the communicator.
        nonfinite: the algorithm's non-finite policy, ``"raise"`` or ``"drop"`` (the same on every rank).
        step: the current step, for the warning.

    Raises:
        NonFiniteError: a buffer is non-finite on some rank and the policy is ``"raise"``, or on every rank.
    """
    named = float_buffers(module)
    tensors = dict(named)
    with torch.no_grad():
        for flat in pack(named):
            local = flat.buffer.clone()
            comm.all_reduce(flat.buffer, "avg")
            if not bool(torch.isfinite(flat.buffer).all()):
                _average_finite_only(flat, local, comm, nonfinite, step)
            for entry in flat.entries:
                tensors[entry.name].copy_(flat.view(entry))


def _average_finite_only(flat: Bucket, local: torch.Tensor, comm: Communicator, nonfinite: str, step: int) -> None:
    """The average was non-finite on every rank: find the culprits and apply the non-finite policy."""
    mine = [entry.name for entry in flat.entries if not bool(torch.isfinite(flat.view(entry, local)).all())]
    culprits = {rank: names for rank, names in enumerate(comm.all_gather_object(mine)) if names}
    ranks = sorted(culprits)
    first = culprits[ranks[0]][0]
    where = f"rank {comm.rank}"  # the wrapper prefixes its errors with the step
    if nonfinite != "drop":
        raise NonFiniteError(
            f"{where}: buffer '{first}' of rank(s) {ranks} holds non-finite values (NaN or Inf); "
            'buffers="average" would spread them to every rank. Fix the divergence, or use '
            "nonfinite='drop' on the algorithm to average over the finite ranks only"
        )
    warnings.warn(
        f"{where}: step {step}: dropped the buffers of rank(s) {ranks} from the average "
        f"(buffer '{first}' holds NaN or Inf)",
        NonFiniteWarning,
        stacklevel=4,
    )
    finite = len(set(range(comm.size)) - set(ranks))
    if finite == 0:
        raise NonFiniteError(f"{where}: buffer '{first}' is non-finite on every rank; nothing left to average")
    flat.buffer.copy_(torch.zeros_like(local) if comm.rank in culprits else local)
    comm.all_reduce(flat.buffer, "sum")
    flat.buffer.div_(finite)
