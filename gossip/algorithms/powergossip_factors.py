"""The numerics of PowerGossip's factors (:mod:`gossip.algorithms.powergossip`): orthonormalisation, the zero-column
rule and the column sums its non-finite check reads.

* :func:`orthonormalize` / :func:`orthonormalize_`: Q of a batch of tall matrices, by one batched Householder QR or
  by modified Gram-Schmidt (:func:`gram_schmidt`), in float64 or float32 (Vogels et al., NeurIPS 2020, Alg. 1: the
  factor is orthonormalised before each product);
* :func:`keep_nonzero_columns_`: a column of the incoming factor that is exactly zero keeps the previous factor's
  column (an edge whose two replicas agree would otherwise send zeros from then on);
* :func:`column_sums` / :func:`replace_factors`: the sums of each incoming factor's columns, one host transfer for
  the whole replacement, and the replacement itself.
"""

from __future__ import annotations

import torch

from gossip.algorithms.powergossip_layout import Replacement


def gram_schmidt(matrix: torch.Tensor, eps: float = 1e-8, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``matrix`` (rows x r, or a batch ... x rows x r).

    Computed in ``dtype`` and returned in ``matrix.dtype``; a new tensor. Column c is divided by its norm (+ ``eps``,
    so a zero column stays zero and finite), then removed from the columns after it: a few kernels per column.

    Args:
        matrix: the columns to orthonormalise.
        eps: added to each norm before dividing.
        dtype: the precision of the computation.

    Returns:
        Orthonormal columns (zero where a column was zero or dependent), in ``matrix.dtype``.
    """
    work = matrix.to(dtype, copy=True)
    columns = work.shape[-1]
    for c in range(columns):
        column = work[..., c : c + 1]
        column.div_(torch.linalg.vector_norm(column, dim=-2, keepdim=True).add_(eps))
        if c + 1 < columns:
            rest = work[..., c + 1 :]
            rest.sub_(column * (column.mT @ rest))
    return work.to(matrix.dtype)


def default_method(device: torch.device) -> str:
    """The orthonormalisation :func:`orthonormalize` uses on ``device`` when none is given.

    QR on the CPU, Gram-Schmidt elsewhere (see :func:`orthonormalize` for why).

    Args:
        device: the device of the factors.

    Returns:
        ``"qr"`` or ``"gram-schmidt"``.
    """
    return "qr" if device.type == "cpu" else "gram-schmidt"


def orthonormalize(
    matrix: torch.Tensor, eps: float = 1e-8, dtype: torch.dtype | None = None, method: str | None = None
) -> torch.Tensor:
    """Orthonormal columns spanning those of ``matrix`` (rows x r, or a batch ... x rows x r).

    Computed in ``dtype`` and returned in ``matrix.dtype``; a new tensor, ``matrix`` is left alone.

    ``method``: ``"qr"``, one batched Householder QR (``torch.linalg.qr``), or ``"gram-schmidt"``
    (:func:`gram_schmidt`). By default QR on the CPU, where LAPACK factors a batch of thin matrices in one call
    whose cost hardly grows with r (``python benchmarks/powergossip_compute.py --kernels`` times both on a model's
    factors; the timings are in benchmarks/README.md), and Gram-Schmidt elsewhere:
    on CUDA ``torch.linalg.qr`` forms Q with one cuSOLVER call per matrix of the batch (cuSOLVER has no batched
    ``orgqr``), while Gram-Schmidt's few kernels per column cover the whole batch (PyTorch's PowerSGD hook takes
    QR only above r = 2, where it found QR usually faster). ``dtype`` by default: float64 for Gram-Schmidt,
    whose loss of orthogonality grows with the conditioning of ``matrix``; for QR, which is backward stable
    (orthonormal to within a small multiple of the unit round-off whatever the conditioning), ``matrix``'s dtype,
    at least float32. QR's columns are orthonormal even where the input's are zero or dependent (Householder
    completes the basis), Gram-Schmidt's zero columns stay zero (``eps`` keeps them finite); the two may differ in
    sign, which does not matter to PowerGossip (p and q flip together). Deterministic: equal inputs on the same
    device and thread count give equal outputs, which is what keeps both ends of an edge bit-identical.

    Args:
        matrix: the columns to orthonormalise.
        eps: Gram-Schmidt's guard against a zero norm.
        dtype: the precision of the computation; None as above.
        method: ``"qr"``, ``"gram-schmidt"``, or None for :func:`default_method`.

    Returns:
        The orthonormal columns, in ``matrix.dtype``.
    """
    if method is None:
        method = default_method(matrix.device)
    if method == "gram-schmidt":
        return gram_schmidt(matrix, eps, dtype or torch.float64)
    work = matrix.to(dtype or (torch.float64 if matrix.dtype == torch.float64 else torch.float32))
    return torch.linalg.qr(work).Q.to(matrix.dtype)


def orthonormalize_(
    matrix: torch.Tensor,
    eps: float = 1e-8,
    dtype: torch.dtype | None = None,
    method: str | None = None,
    triangle: torch.Tensor | None = None,
) -> None:
    """:func:`orthonormalize` written over ``matrix``, with the same bits.

    QR in ``matrix``'s own dtype takes ``matrix`` as its Q output and ``triangle`` (``... x r x r``, allocated when
    not given) as its R: LAPACK factors a column-major batch in place (PowerGossip stores its factors transposed,
    so their ``mT`` views are column-major), which saves copying a new Q back. Otherwise the result is computed
    aside and copied back.

    Args:
        matrix: the columns to orthonormalise, in place.
        eps: Gram-Schmidt's guard against a zero norm.
        dtype: the precision of the computation; None as :func:`orthonormalize`.
        method: ``"qr"``, ``"gram-schmidt"``, or None for :func:`default_method`.
        triangle: a buffer for QR's triangular factor, or None.
    """
    method = method or default_method(matrix.device)
    work_dtype = dtype or (torch.float64 if matrix.dtype == torch.float64 else torch.float32)
    if method == "qr" and work_dtype == matrix.dtype:
        if triangle is None:
            triangle = matrix.new_empty(*matrix.shape[:-2], matrix.shape[-1], matrix.shape[-1])
        torch.linalg.qr(matrix, out=(matrix, triangle))
    else:
        matrix.copy_(orthonormalize(matrix, eps, dtype, method))


def keep_nonzero_columns_(incoming: torch.Tensor, factor: torch.Tensor) -> None:
    """The warm-start rule (step 4 above) on blocks whose rows are factor columns (factors stored transposed).

    ``factor``'s rows become ``incoming``'s (R's) except where ``incoming``'s row is zero throughout, which keep
    their values; in place, on the device (no host sync).

    A zero column of R means the two models did not differ along the projection (identical replicas: the first
    step after the initial broadcast, or right after a global average); taken as the next projection it would
    orthonormalise to a direction that knows nothing of the models (zero under Gram-Schmidt, silencing that column
    of the edge for good), while the previous factor still spans a useful one. Both ends hold the same R and the
    same previous factors, so they choose alike.

    Args:
        incoming: R, a row per factor column.
        factor: the factors it replaces, laid out alike; overwritten in place.
    """
    torch.where(incoming.abs().amax(dim=-1, keepdim=True) > 0, incoming, factor, out=factor)


def column_sums(replaced: Replacement, received_exact: torch.Tensor | None) -> list[float]:
    """Every factor column's sum in R (``replaced.incoming``) and, when given, the sum of ``received_exact``.

    One ``sum`` per class and one for the uncompressed tensors, read on the host in one transfer (on the CPU a
    load). Laid out as ``replaced.sums``. They answer two questions at the cost of one reduction: a NaN or Inf
    element makes its sum non-finite (finite elements make a finite sum unless it overflows, which
    :meth:`PowerGossip._check_on_host` tells apart with an exact check), and a column zero throughout sums to 0
    (a column whose elements cancel does too: :func:`replace_factors` then decides column by column).

    Args:
        replaced: where the plan's R goes.
        received_exact: the received uncompressed tensors, packed, or None.

    Returns:
        The columns' sums, then the uncompressed tensors' sum when given.
    """
    for incoming, _, sums in replaced.blocks:
        torch.sum(incoming, dim=-1, out=sums)
    if received_exact is not None:
        torch.sum(received_exact, dim=0, out=replaced.exact_sum)
    return replaced.sums.tolist()


def replace_factors(replaced: Replacement, maybe_zero_column: bool | None) -> None:
    """R replaces the factors, but for its columns zero throughout (the warm-start rule, step 4 above).

    In training R has zero elements at almost every iteration -- products of replicas that agree on some rows,
    rounded alike -- but a zero column only on identical replicas.

    Args:
        replaced: where the plan's R goes.
        maybe_zero_column: False when no column of R sums to 0 (from :func:`column_sums`), so none is zero
            throughout; True or None (not known on the host) decides it on the device, column by column.
    """
    if maybe_zero_column is False:
        replaced.flat.copy_(replaced.incoming)
        return
    for incoming, factor, _ in replaced.blocks:
        keep_nonzero_columns_(incoming, factor)
