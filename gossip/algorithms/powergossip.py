"""PowerGossip: gossip of model differences through a rank-r projection both ends of an edge share.

Vogels, Karimireddy, Jaggi, "PowerGossip: Practical Low-Rank Communication Compression in Decentralized Deep
Learning", NeurIPS 2020 (arXiv 2008.01425); docs/design.md section A. For an edge lo < hi with weight w and a
weight matrix X (reshaped to m x k), one power iteration on both ends is:

1. Parity of the edge's own iteration counter t (kept per edge, not per worker: a per-worker counter on a
   schedule of even period always lands an edge on the same parity and consensus stalls, A.8).
2. t odd (right):  q <- orthonormalize(q);  a_me = X_me q   (m x r).
   t even (left):  p <- orthonormalize(p);  a_me = X_me^T p (k x r).
3. Send a_me to the peer, receive a_peer -- the peer's product exactly, so both ends hold the same operands.
4. R = a_hi - a_lo, computed identically on both ends (lo: received - own, hi: own - received).
   t odd:  p <- R;   t even:  q <- R.   U = p q^T, i.e. (X_hi - X_lo) projected on the shared subspace.
   A column of R that is exactly zero (the two models agree along it, e.g. identical replicas right after the
   initial broadcast or a global average) keeps the previous factor's column as the next warm start instead: a
   zero factor would orthonormalise to zero and silence that column of the edge for good. U is formed from R
   itself, so that column moves nothing this iteration (identical replicas stay identical).
5. X_lo += gamma w U  and  X_hi -= gamma w U: equal and opposite, so with symmetric W the sum over ranks is
   preserved; the part of X_hi - X_lo not sent stays in the models and is picked up later (no error feedback).

Both ends hold bit-identical p and q: they start from the same pair-seeded draw (seed n^2 + lo n + hi, A.2),
compute R from the same two operands, and orthonormalize identical inputs with identical code.

Batching (as PyTorch's PowerSGD communication hook batches its matrices): matrices of one shape and one role
(``blocks.#.mlp.fc.weight``) -- the layers of a transformer -- are one group with stacked factors. The products and
the update run as one ``bmm`` / ``baddbmm_`` per run of the group's layers lying at equal distances in one bucket, a
(count, m, k) strided view of the bucket without a copy (one run per bucket the layers span). Factors are stored
transposed (r x rows), so the products are q^T X^T and p^T X, small dimension first (how they compare with X q and
X^T p on the CPU: ``benchmarks/powergossip_compute.py --kernels``, timings in benchmarks/README.md). Factors of
equal rows are orthonormalised together, and so are those within a factor ``pad_ratio`` of each other (default
``PAD_RATIO`` on CUDA, ``CPU_PAD_RATIO`` on the CPU), the smaller ones zero-padded: one batched call per class (on a
GPT, every q in one call), not per group. The padding is stored: each edge keeps its factors in one flat buffer per
side, ordered class by class, every factor padded with zero rows to its class's rows, so that a class is one
contiguous block orthonormalised in place, and the factors are views of it (QR and Gram-Schmidt leave zero rows
zero). At these sizes an operation costs more than its arithmetic, on the CPU as on a GPU, so padding pays
(``pad_ratio`` bounds the work spent on zeros). Each edge plans each side's iteration once (both in
:mod:`gossip.algorithms.powergossip_layout`): its message, the products, updates and orthonormalisations as views of
the buffers and of the buckets. One message per peer and iteration carries the products of every group, then (in the
step's first iteration, see below) the uncompressed tensors of all buckets packed (one ``cat`` of views taken at
setup, unpacked with one ``_foreach_copy_``); the difference of the two ends' products is one subtraction written
over the received message, laid out as the factors it replaces with one ``_foreach_copy_`` (padded, a row per factor
column), where one sum per class sums every column for the warm-start rule of step 4. So an iteration's operations
-- on a GPU, kernel launches, whose fixed cost dominates at these sizes -- do not grow with the number of layers or
of uncompressed tensors, except for the runs (keep the layers in few buckets), and no tensor is cut or allocated on
the way. On CUDA no value is read back to the host on the hot path: the non-finite check is deferred (see
gossip.algorithms.base) and the rule decided on the device. On the CPU, where a host read is a load, one read per
peer and iteration serves both: the columns' sums in R (a NaN or Inf a peer sent is one in R and makes its column's
sum non-finite; a column zero throughout sums to 0, and R has one only on identical replicas, so the rule mostly has
nothing to do) and the sum of the uncompressed tensors received.

Orthonormalisation (:func:`orthonormalize`): by default Householder QR on the CPU, Gram-Schmidt elsewhere (on
CUDA, batched QR costs a cuSOLVER call per matrix); ``orthonormalization`` ("qr", "gram-schmidt") chooses.
Precision: ``orthonormalize_dtype`` (default None: float64 for Gram-Schmidt, the parameters' dtype and at least
float32 for QR, which is backward stable). The precision of the basis only shapes how well the projection
captures X_hi - X_lo, never the invariants (both ends apply the same correction with opposite signs). Either way
both ends run the same kernel on the same input, so they agree bit for bit; both choices are part of ``config()``
and so of checkpoints. These two, ``pad_ratio`` and ``uncompressed_every_iteration`` (below) are the seldom-tuned
settings, passed together as ``PowerGossip(tuning=PowerGossipTuning(...))``.

Message precision (``message_dtype``): by default the products travel in the parameters' dtype. With torch.float16
or torch.bfloat16 each end rounds its products to that dtype before sending, and both compute R = a_hi - a_lo in the
parameters' dtype from the two rounded products (widened exactly for float32 or float64 parameters): the same two
operands on both ends, whatever the conversion, so the factors stay bit-identical and the corrections equal and
opposite (the sum is preserved). Rounding to nearest perturbs each product by at most the unit round-off of its
magnitude, 2^-11 (float16) or 2^-8 (bfloat16), for normal numbers; what it misses of X_hi - X_lo stays in the models
for later iterations, like the part outside the projection. float16 keeps more bits but overflows above 65504 (the
receiving end's non-finite error names it); bfloat16 has float32's range. Half-precision products halve the
products' bytes, so twice the power iterations cost what one did. The uncompressed tensors keep the parameters'
dtype (their exact gossip stays exact) in a second tensor of the message.

Factors of an idle edge are kept, so warm starts survive time-varying schedules that revisit pairs (A.8).
Tensors with fewer than two dimensions and matrices whose compression ratio m k / (r (m + k)) is below
``min_compression`` travel uncompressed, mixed as exact gossip (A.5, D.3); ``policy`` overrides the choice per
parameter name. Parameters with 0 elements travel as nothing. The uncompressed tensors are mixed once per step,
in the message of the first power iteration (posted before forward and backward, so it overlaps them); the
further iterations carry the products only. With one peer per step and gamma = 1 (the one-peer schedules) a
second exact mixing would change nothing -- both ends already hold the pair's average -- and would cost the
uncompressed tensors' bytes again (their share of the main job's message: benchmarks/README.md).
``PowerGossipTuning(uncompressed_every_iteration=True)`` mixes them with every iteration, which repeats the
averaging where the step has several peers or gamma < 1.

Delayed last iteration (``delayed_last_iteration=True``, with ``num_iterations`` >= 2): the first iteration's
exchange is posted at ``start`` and overlaps forward and backward, but the further ones must complete before the
optimizer step: posted during backward once the previous one has arrived (below) or in ``finish``, their exchanges
overlap at most the rest of backward. With the option, the last iteration of step t is posted in step t's
``finish`` and applied in step t + 1's ``finish``, before that step's first iteration: its exchange overlaps the
optimizer's update and step t + 1's forward and backward. The correction it applies was computed from the replicas
before step t's update (a delay of one step, as the first iteration's products are taken before forward and
backward). Both ends of an edge still apply equal and opposite corrections from the same R, so the sum over ranks
stays preserved. An edge that the schedule uses again at step t + 1 is applied at once instead (its next iteration
needs the factors R replaces); both ends decide alike, since a symmetric schedule lists each in the other's peers.
``close()`` completes and drops the delayed exchange (the parameters keep x_t, as for the exchange in flight); a
checkpoint waits for it and stores its messages (:meth:`PowerGossip.in_flight_state`), so a resumed run applies it
as the uninterrupted one does. The uncompressed tensors must be mixed once per step (a delayed exact mixing would
write values from before the update over it), and a composite's part or an :class:`AdaptivePowerGossip` cannot
delay (they do not pass the delayed exchange on).

Iterations during backward (``PowerGossipTuning(iterations_during_backward=True)``, the default; with
``num_iterations`` >= 2 and without ``delayed_last_iteration``). Every iteration of step t is a function of the
replicas x_t of the step's edges alone: iteration k + 1 multiplies X_t + (the corrections of iterations 0..k),
which depend only on x_t and on the factors, and the optimizer's update of step t comes after all of them. So
iteration k + 1 can run as soon as iteration k's exchange has arrived, before backward has ended -- but not on the
parameters, which backward still reads. :meth:`PowerGossip.progress`, which the wrapper calls from its backward
hooks, checks without waiting whether the exchange in flight has completed; if so, it applies that iteration to a
copy of the parameters (filled with x_t at the step's first such call; :mod:`gossip.algorithms.powergossip_shadow`)
and posts the next iteration's products, taken from the copy, so that its exchange overlaps the rest of backward.
``finish`` waits for what is still in flight, runs the iterations not started yet on the copy, and writes the copy
into the parameters. The copy's views have the buckets' shapes, strides and offsets, and the same kernels run on
the same values in the same order, so the parameters and both ends' factors are bit for bit those of the step run
entirely in ``finish`` (a test pins it on the simulator, Gloo and MPI); ranks may differ in the setting. A round
holding a NaN or Inf (on the CPU, where that is checked on the host) is left to ``finish``, which raises or warns
as without it. Cost: one copy of the parameters in memory, and two copies of them per step. Nothing is kept
across steps, so checkpoints and ``close()`` are as without it. A communicator runs its operations in order, so
before a collective inside the step (``averaged()``, a consensus distance, a checkpoint) the wrapper has every rank
post its further iterations first (``progress(pending, wait=True)``, also where the setting is off): a peer that
had posted one early would otherwise hold the collective behind an exchange this rank posts only in ``finish``.

``nonfinite="drop"``: when a peer's products or uncompressed tensors hold NaN or Inf, this end skips that
edge's correction for the step (its uncompressed tensors' weight goes back to the self weight, so that row stays
stochastic) and keeps its factors p and q as they were. The edge's parity counter still advances, so both ends
keep multiplying on the same side (else the next messages would differ in shape). Once both ends send finite
products again, two iterations make their factors identical again (both compute R from the same two operands).
The peer still applies its own side of the edge, so the sum over ranks is not preserved that step. On the CPU
R also shows this rank's own products non-finite (its replica diverged, or a product overflowed a float16 message):
with ``"raise"`` that is an error naming this rank, with ``"drop"`` a warning, and this end skips the corrections
its own products would have spread over its parameters.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial

import torch

from gossip.algorithms.base import Algorithm, all_finite_on_host, check_nonfinite_policy
from gossip.algorithms.buckets import Bucket, Entry
from gossip.algorithms.cuda_graphs import CapturedKernels
from gossip.algorithms.powergossip_factors import column_sums, default_method, orthonormalize_, replace_factors
from gossip.algorithms.powergossip_layout import (
    CPU_PAD_RATIO,
    PAD_RATIO,
    EdgeState,
    Layout,
    Matrix,
    Plan,
    Replacement,
    Side,
    group_matrices,
)
from gossip.algorithms.powergossip_shadow import Shadow, twin_plan
from gossip.backends.base import Communicator
from gossip.backends.comm_thread import CompletedHandle, Handle
from gossip.errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError, NonFiniteWarning
from topologies import Schedule

Policy = Callable[[str, torch.Size], "bool | None"]


def exclude_names(*patterns: str) -> Policy:
    """A policy sending every parameter whose name matches one of the regular expressions uncompressed.

    Args:
        *patterns: regular expressions, searched in each parameter's name.

    Returns:
        The policy: False for a matching name, None (PowerGossip's own choice) for the others.
    """
    compiled = [re.compile(pattern) for pattern in patterns]
    return lambda name, shape: False if any(p.search(name) for p in compiled) else None


METHODS = ("qr", "gram-schmidt")
MESSAGE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, kw_only=True)
class PowerGossipTuning:
    """PowerGossip's seldom-tuned settings: how its power iterations are computed, chosen by benchmarks.

    The benchmarks are ``benchmarks/powergossip_compute.py`` and ``benchmarks/gpu_step.py``; the defaults suit the
    device. Pass one as ``PowerGossip(tuning=PowerGossipTuning(...))`` to reproduce a benchmark's setting, or to give
    every rank of a world that mixes CPU and GPU ranks the same choices (docs/design.md A).

    Attributes:
        orthonormalization: ``"qr"`` or ``"gram-schmidt"``; None: QR on the CPU, Gram-Schmidt elsewhere
            (:func:`default_method`). Part of :meth:`PowerGossip.config`.
        orthonormalize_dtype: None, torch.float32 or torch.float64, the precision of the orthonormalisation
            (None: float64 for Gram-Schmidt, the parameters' dtype and at least float32 for QR;
            :func:`orthonormalize`). Part of :meth:`PowerGossip.config`.
        pad_ratio: factors within this ratio of rows are orthonormalised in one zero-padded call
            (:func:`gossip.algorithms.powergossip_layout.row_classes`); None: ``PAD_RATIO`` on CUDA,
            ``CPU_PAD_RATIO`` on the CPU. Changes only the rounding.
        uncompressed_every_iteration: mix the uncompressed tensors with every power iteration instead of once
            per step (the module docstring says when that repeats the averaging). Part of :meth:`PowerGossip.config`.
        cuda_graphs: on CUDA, launch each plan's kernels between two exchanges as one CUDA graph
            (:mod:`gossip.algorithms.cuda_graphs`) when the sequence is fixed: warm-started factors, Gram-Schmidt,
            and the non-finite check deferred on the device (``nonfinite="raise"``), and one rank per process
            (not on the simulator's threads). The same kernels run, with the same results (a GPU test compares
            both); not part of the config.
        iterations_during_backward: with ``num_iterations`` >= 2, run each further power iteration of a step as
            soon as the previous one's exchange has arrived, during backward (:meth:`PowerGossip.progress`, which
            the wrapper calls from its backward hooks), on a copy of the parameters, so that its exchange overlaps
            the rest of backward instead of waiting for the optimizer step; the same results bit for bit (module
            docstring, "Iterations during backward"), for one more copy of the parameters in memory. Not part of
            the config (ranks may differ in it).
    """

    orthonormalization: str | None = None
    orthonormalize_dtype: torch.dtype | None = None
    pad_ratio: int | None = None
    uncompressed_every_iteration: bool = False
    cuda_graphs: bool = True
    iterations_during_backward: bool = True

    def __post_init__(self) -> None:
        if self.orthonormalization not in (None, *METHODS):
            raise InvalidArgumentError(
                f"PowerGossipTuning: orthonormalization must be None or one of {METHODS}, "
                f"got {self.orthonormalization!r}"
            )
        if self.orthonormalize_dtype not in (None, torch.float32, torch.float64):
            raise InvalidArgumentError(
                "PowerGossipTuning: orthonormalize_dtype must be None, torch.float32 or torch.float64, "
                f"got {self.orthonormalize_dtype!r}"
            )
        pad_ratio = self.pad_ratio
        if pad_ratio is not None and (isinstance(pad_ratio, bool) or not isinstance(pad_ratio, int) or pad_ratio < 1):
            raise InvalidArgumentError(
                f"PowerGossipTuning: pad_ratio must be None or an integer >= 1, got {pad_ratio!r}"
            )
        object.__setattr__(self, "uncompressed_every_iteration", bool(self.uncompressed_every_iteration))
        object.__setattr__(self, "cuda_graphs", bool(self.cuda_graphs))
        object.__setattr__(self, "iterations_during_backward", bool(self.iterations_during_backward))


@dataclass
class _Round:
    step: int
    seq: int
    peers: list[tuple[int, float, EdgeState, Plan]]  # peer, weight, edge, its plan for this iteration's side
    handle: Handle
    exact: bool  # whether the messages carry the uncompressed tensors
    right: bool = False  # the side of the multiplication (a delayed round's plans are looked up again on resume)
    shadow: bool = False  # its plans multiply and update the copy of the parameters (progress), not the buckets


@dataclass
class _Ahead:
    """The open step's power iterations that :meth:`PowerGossip.progress` ran before ``finish``."""

    step: int
    in_peers: list[tuple[int, float]]
    rounds: list[_Round]  # iteration k's round at index k; the last one may still be in flight
    applied: int = 0  # how many of them were applied to the copy (which holds x_t from the first on)
    stopped: bool = False  # a round held a non-finite value: finish applies the rest, so that it raises or warns


class PowerGossip(Algorithm):
    """Low-rank gossip of model differences with warm-started, per-edge shared projections.

    The settings users tune, in the order to tune them:

    1. ``rank``: the rank r of the projection, which sets the compression (a matrix m x k sends r (m + k) numbers
       instead of m k). Start at 1 and double while the consensus distance or the loss asks for it; 1-4 is usual.
       (The ``"rank"`` of :meth:`config`; the instance keeps it as ``matrix_rank``, so that it is never confused
       with the process rank ``comm.rank``.)
    2. ``num_iterations``: power iterations (exchanges) per step; each sends the products again, and moves the
       replicas closer along a refreshed projection.
    3. ``gamma``: the step size of the correction (each end of an edge moves by gamma times the edge's weight
       times the projected difference).
    4. ``message_dtype``: the products' dtype on the wire (None: the parameters'); torch.float16 or
       torch.bfloat16 halve their bytes (the module docstring says what the rounding costs).

    Seldom tuned: ``min_compression`` (a matrix is compressed only when m k / (r (m + k)) reaches it, else sent
    whole) and ``policy`` (a per-parameter override of that choice, e.g. :func:`exclude_names`); ``seed`` (of the
    pair-seeded initial factors); ``nonfinite`` ("raise" or "drop", what a peer's NaN or Inf does). Keep
    ``warm_start`` on: each edge's factors carry over from iteration to iteration, which is what lets one or two
    power iterations per step suffice.

    Implementation settings that benchmarks choose -- the orthonormalisation's method and precision, the padding
    of its batches, mixing the uncompressed tensors with every iteration -- are gathered in ``tuning``, a
    :class:`PowerGossipTuning`; the defaults suit the device. Every argument but the first three is keyword-only.

    Args:
        rank: r, the rank of the projection (an integer >= 1).
        num_iterations: power iterations per step (an integer >= 1).
        gamma: the step size of the correction (positive).
        message_dtype: the products' dtype on the wire; None: the parameters'.
        min_compression: the least ratio m k / (r (m + k)) at which a matrix is compressed (>= 1).
        policy: a per-parameter override, ``(name, shape) -> True | False | None``.
        seed: the seed of the pair-seeded initial factors.
        nonfinite: ``"raise"`` or ``"drop"``, what a peer's NaN or Inf does.
        warm_start: carry each edge's factors over from iteration to iteration.
        tuning: the seldom-tuned settings; None: the defaults.
        delayed_last_iteration: apply the last power iteration at the next step, so that its exchange overlaps
            that step's compute (module docstring); needs ``num_iterations`` >= 2.

    Raises:
        InvalidArgumentError: a setting is out of range, ``message_dtype`` is not a supported dtype, or
            ``delayed_last_iteration`` is asked with one iteration or with the uncompressed tensors mixed every
            iteration.
        ArgumentTypeError: ``tuning`` is not a :class:`PowerGossipTuning`.
    """

    name = "powergossip"
    state_dict_is_snapshot = True  # copies of the factors and generator states
    needs_symmetric_schedule = True
    can_delay = True  # whether delayed_last_iteration is allowed (a subclass that rebuilds its edges: False)

    def __init__(
        self,
        rank: int = 1,
        num_iterations: int = 1,
        gamma: float = 1.0,
        *,
        message_dtype: torch.dtype | None = None,
        min_compression: float = 2.0,
        policy: Policy | None = None,
        seed: int = 0,
        nonfinite: str = "raise",
        warm_start: bool = True,
        tuning: PowerGossipTuning | None = None,
        delayed_last_iteration: bool = False,
    ):
        if message_dtype not in MESSAGE_DTYPES:
            raise InvalidArgumentError(
                "PowerGossip: message_dtype must be None (the parameters' dtype) or one of torch.float16, "
                f"torch.bfloat16, torch.float32 and torch.float64, got {message_dtype!r}"
            )
        if tuning is not None and not isinstance(tuning, PowerGossipTuning):
            raise ArgumentTypeError(f"PowerGossip: tuning must be a PowerGossipTuning or None, got {tuning!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise InvalidArgumentError(f"PowerGossip: rank must be an integer >= 1, got {rank!r}")
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, int) or num_iterations < 1:
            raise InvalidArgumentError(f"PowerGossip: num_iterations must be an integer >= 1, got {num_iterations!r}")
        if not gamma > 0:
            raise InvalidArgumentError(f"PowerGossip: gamma must be positive, got {gamma}")
        if not min_compression >= 1:
            raise InvalidArgumentError(f"PowerGossip: min_compression must be >= 1 (a ratio), got {min_compression}")
        self.matrix_rank, self.num_iterations, self.gamma = rank, num_iterations, float(gamma)
        self.warm_start, self.min_compression, self.policy, self.seed = warm_start, min_compression, policy, seed
        self.nonfinite = check_nonfinite_policy("PowerGossip", nonfinite)
        self.tuning = tuning if tuning is not None else PowerGossipTuning()
        self.message_dtype = message_dtype
        self.edges: dict[tuple[int, int], EdgeState] = {}
        self.delayed_last_iteration = bool(delayed_last_iteration)
        if self.delayed_last_iteration and (num_iterations < 2 or self.tuning.uncompressed_every_iteration):
            raise InvalidArgumentError(
                "PowerGossip: delayed_last_iteration needs num_iterations >= 2 (the first iteration overlaps the "
                "step already) and the uncompressed tensors mixed once per step (uncompressed_every_iteration "
                f"False), got num_iterations={num_iterations}, uncompressed_every_iteration="
                f"{self.tuning.uncompressed_every_iteration}"
            )
        self._delayed: _Round | None = None  # the last iteration of the previous step, applied at this one's finish
        self._ahead: _Ahead | None = None  # the open step's iterations run during backward (progress)
        self._shadow: Shadow | None = None  # the copy of the parameters they run on, allocated on first use
        #: Power iterations posted by :meth:`progress` before ``finish`` so far (the ones overlapped with backward).
        self.posted_ahead = 0

    # -- binding --------------------------------------------------------------------------------------------
    def _compress(self, entry: Entry) -> bool:
        shape = entry.shape
        if shape.numel() == 0:
            return False  # nothing to send either way
        choice = self.policy(entry.name, shape) if self.policy is not None else None
        if choice is None:
            if len(shape) < 2:
                return False
            m, k = shape[0], shape.numel() // shape[0]
            return m * k / (self.largest_matrix_rank() * (m + k)) >= self.min_compression
        if choice and len(shape) < 2:
            raise InvalidArgumentError(
                f"PowerGossip policy: parameter {entry.name!r} of shape {tuple(shape)} is not a matrix"
            )
        largest = self.largest_matrix_rank()
        if choice and min(shape[0], shape.numel() // shape[0]) < largest:
            raise InvalidArgumentError(
                f"PowerGossip: rank {largest} is larger than parameter {entry.name!r} of shape {tuple(shape)} "
                f"allows (at most {min(shape[0], shape.numel() // shape[0])})"
            )
        return bool(choice)

    def largest_matrix_rank(self) -> int:
        """The largest projection rank this instance will use.

        :meth:`setup` compresses only the matrices that allow it at ``min_compression``. A subclass that changes the
        rank while training overrides it (its ladder's top rung), so that the set of compressed matrices never
        changes.

        Returns:
            The rank.
        """
        return self.matrix_rank

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        """Bind, choose the compressed matrices and batch them into groups (:func:`group_matrices`).

        Args:
            comm: this rank's communicator.
            schedule: the gossip schedule (required).
            buckets: the parameter buckets to mix in place, of one floating-point dtype.

        Raises:
            InvalidArgumentError: no schedule, or ``policy`` asks to compress a parameter that is not a matrix or is
                too small for the rank.
            ArgumentTypeError: the parameters have several dtypes, or a bucket is not floating-point.
        """
        if schedule is None:
            raise InvalidArgumentError("PowerGossip needs a schedule (e.g. topologies.one_peer_hypercube(n))")
        if self.delayed_last_iteration and (self._part_of is not None or not self.can_delay):
            owner = type(self._part_of or self).__name__
            raise InvalidArgumentError(
                f"rank {comm.rank}: {owner} does not pass a delayed exchange on from step to step: use "
                "delayed_last_iteration=False there (it is for a PowerGossip that the wrapper runs itself)"
            )
        if self._delayed is not None:  # bound again mid-run: its plans hold views of the previous binding
            self.drain()
        self._ahead, self._shadow, self._shadow_exact = None, None, []
        super().setup(comm, schedule, buckets)
        dtypes = {str(bucket.buffer.dtype).removeprefix("torch.") for bucket in buckets}
        if len(dtypes) > 1:
            raise ArgumentTypeError(
                f"rank {comm.rank}: PowerGossip sends each step's factors in one message of one dtype, but the "
                f"parameters have dtypes {sorted(dtypes)}: convert the model to one dtype before wrapping "
                "(e.g. model.float()), or use ExactGossip, which mixes every dtype"
            )
        self.matrices: list[Matrix] = []
        self.exact: list[tuple[int, Entry]] = []
        for index, bucket in enumerate(buckets):
            if not bucket.buffer.is_floating_point():
                raise ArgumentTypeError(
                    f"PowerGossip: bucket {index} holds {bucket.buffer.dtype}; parameters must be floats"
                )
            for entry in bucket.entries:
                if self._compress(entry):
                    m, k = entry.shape[0], entry.numel // entry.shape[0]
                    self.matrices.append(Matrix(bucket=index, entry=entry, m=m, k=k))
                else:
                    self.exact.append((index, entry))
        self.groups = group_matrices(self.matrices)
        # The uncompressed tensors of all buckets travel packed behind the products (the entries are small:
        # biases, norms), so an iteration sends one message per peer, not one per tensor or bucket. Their flat
        # views are taken once here, one per run of them lying next to each other in a bucket (a norm's weight
        # and bias, a bias and the next layer's norm): packing is one ``cat``, unpacking one ``_foreach_copy_``.
        runs: list[list[int]] = []  # [bucket, offset, numel]
        for index, entry in self.exact:
            if runs and runs[-1][0] == index and runs[-1][1] + runs[-1][2] == entry.offset:
                runs[-1][2] += entry.numel
            else:
                runs.append([index, entry.offset, entry.numel])
        self._exact_views = [buckets[index].buffer[offset : offset + numel] for index, offset, numel in runs]
        self._exact_sizes = [numel for _, _, numel in runs]
        self._exact_numel = sum(self._exact_sizes)
        self._views: list[list[tuple[slice, torch.Tensor]]] = []  # per group: (its members' slice, (count, m, k))
        for group in self.groups:
            views, start = [], 0
            for run in group.runs:
                buffer = buckets[run.bucket].buffer
                shape, strides = (run.count, group.m, group.k), (run.stride, group.k, 1)
                view = buffer.as_strided(shape, strides, buffer.storage_offset() + run.offset)
                views.append((slice(start, start + run.count), view))
                start += run.count
            self._views.append(views)
        on_cuda = any(bucket.buffer.is_cuda for bucket in buckets)
        pad_ratio = self.tuning.pad_ratio
        self._pad_ratio = pad_ratio if pad_ratio is not None else PAD_RATIO if on_cuda else CPU_PAD_RATIO
        self._layouts: dict[int, Layout] = {}  # per rank r
        self._orthonormalization = self.tuning.orthonormalization or default_method(self._device)  # chosen once
        for edge in self.edges.values():  # bound again: plans hold views of the previous binding's buckets
            edge.plans.clear()
        # the same kernels at every step: warm-started factors, Gram-Schmidt, the non-finite check on the device
        fixed = self.warm_start and self._orthonormalization == "gram-schmidt" and self.nonfinite == "raise"
        self._captured = (
            CapturedKernels(
                self._device,
                f"rank {comm.rank}: {type(self).__name__}",
                "PowerGossip(tuning=PowerGossipTuning(cuda_graphs=False)) launches every sequence one by one",
            )
            if on_cuda and self.tuning.cuda_graphs and fixed and not comm.ranks_share_a_process
            else None
        )

    def describe(self) -> dict[str, list[str]]:
        """Which parameters are compressed and which travel exactly.

        Returns:
            ``{"compressed": names, "exact": names}``.
        """
        return {"compressed": [m.entry.name for m in self.matrices], "exact": [e.name for _, e in self.exact]}

    # -- per-edge state -------------------------------------------------------------------------------------
    def edge(self, peer: int) -> EdgeState:
        """The state of the edge to ``peer``, created on first use from the pair-seeded generator.

        The pair (lo, hi) is seeded with seed n^2 + lo n + hi, so both ends draw the same factors.

        Args:
            peer: the other end of the edge.

        Returns:
            The edge's state, shared by both directions.
        """
        lo, hi = sorted((self.comm.rank, peer))
        key = (lo, hi)
        if key not in self.edges:
            n = self.comm.size
            dtype = self.buckets[0].buffer.dtype if self.buckets else torch.float32
            device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
            seed = self.seed * n * n + lo * n + hi
            self.edges[key] = EdgeState.fresh(
                seed=seed, matrices=self.matrices, groups=self.groups, layout=self._layout(), device=device, dtype=dtype
            )
        return self.edges[key]

    def _matrix(self, matrix: Matrix) -> torch.Tensor:
        return self.buckets[matrix.bucket].view(matrix.entry).reshape(matrix.m, matrix.k)

    # -- one power iteration --------------------------------------------------------------------------------
    def _layout(self) -> Layout:
        """Both sides' layouts at the current rank; built once per rank (a subclass may change it while
        training). Factors of similar rows are orthonormalised together, zero-padded (see
        :func:`gossip.algorithms.powergossip_layout.row_classes`)."""
        if self.matrix_rank not in self._layouts:
            r, groups, pad_ratio, device = self.matrix_rank, self.groups, self._pad_ratio, self._device
            p = Side.build(groups, [g.m for g in groups], r, pad_ratio, device)
            q = Side.build(groups, [g.k for g in groups], r, pad_ratio, device)
            self._layouts[r] = Layout(rank=r, p=p, q=q)
        return self._layouts[self.matrix_rank]

    def _plan(self, peer: int, edge: EdgeState, right: bool, exact: bool) -> Plan:
        """``edge``'s (to ``peer``) plan for a right (or left) multiplication at the current rank, its message
        carrying the uncompressed tensors or not (``exact``), built on first use."""
        plan = edge.plans.get((right, exact))
        if plan is not None:
            return plan
        layout, r = self._layout(), self.matrix_rank
        out = layout.p if right else layout.q  # the layout of the side R replaces
        exact_numel = self._exact_numel if exact else 0
        sent = torch.empty(out.numel + exact_numel, dtype=self._dtype, device=self._device)
        received = torch.empty_like(sent)
        if self._message_dtype == self._dtype:  # one message; R is written over the received products
            messages, inboxes = [sent], [received]
            sent_products, received_products = sent[: out.numel], received[: out.numel]
            difference = received_products
        else:  # the products rounded into their own message; R computed into sent's head from the rounded two
            sent_products = torch.empty(out.numel, dtype=self._message_dtype, device=self._device)
            received_products = torch.empty_like(sent_products)
            messages = [sent_products, *([sent[out.numel :]] if exact else [])]
            inboxes = [received_products, *([received[out.numel :]] if exact else [])]
            difference = sent[: out.numel]
        groups, stacks = self.groups, (edge.qt_stacks if right else edge.pt_stacks)
        r_blocks = out.stacks(difference, groups, r)  # R's group views
        replaced = self._replacement(edge.p_flat if right else edge.q_flat, out, difference, r_blocks)
        sent_blocks = out.stacks(sent[: out.numel], groups, r)
        products, updates = [], []
        for g, views in enumerate(self._views):
            for members, x in views:
                if right:  # sends (X q)^T = q^T X^T; R is the next p^T, and X += p q^T = (R^T) (q^T)
                    products.append((stacks[g][members], x.mT, sent_blocks[g][members]))
                    updates.append((x, r_blocks[g][members].mT, stacks[g][members]))
                else:  # sends (X^T p)^T = p^T X; R is the next q^T, and X += p q^T = (p^T)^T R
                    products.append((stacks[g][members], x, sent_blocks[g][members]))
                    updates.append((x, stacks[g][members].mT, r_blocks[g][members]))
        sent_exact = sent[out.numel :]
        flat, side = (edge.q_flat, layout.q) if right else (edge.p_flat, layout.p)
        plan = edge.plans[right, exact] = Plan(
            messages=messages,
            inboxes=inboxes,
            sent_products=sent_products,
            received_products=received_products,
            difference=difference,
            rounded=difference is not received_products,
            sent_exact=sent_exact,
            sent_exact_parts=list(sent_exact.split(self._exact_sizes)) if exact else [],
            received_exact=received[out.numel :],
            products=products,
            updates=updates,
            factor=stacks,
            classes=[(block, block.new_empty(block.shape[0], r, r)) for block in side.blocks(flat, r)],
            replaced=replaced,
            exchange=self.comm.plan_exchange([(peer, m) for m in messages], [(peer, inbox) for inbox in inboxes]),
        )
        return plan

    def _replacement(
        self, flat: torch.Tensor, side: Side, difference: torch.Tensor, sources: list[torch.Tensor]
    ) -> Replacement:
        """Where R (``difference``, in the message layout of ``side``; ``sources`` its group views) goes: the factor
        buffer ``flat``, through a zero-padded buffer laid out as ``flat`` when ``side`` pads."""
        if side.positions is None:  # the message's layout is the factor buffer's
            incoming, stored = difference, []
        else:
            incoming = difference.new_zeros(side.stored_numel)
            stored = side.stored_stacks(incoming, self.groups, self.matrix_rank)
        sums = flat.new_empty(side.columns + 1)
        per_class = sums[:-1].split([block.shape[0] for block in side.column_blocks(flat)])
        blocks = list(zip(side.column_blocks(incoming), side.column_blocks(flat), per_class, strict=True))
        return Replacement(
            flat=flat,
            incoming=incoming,
            stored=stored,
            sources=sources,
            blocks=blocks,
            sums=sums,
            exact_sum=sums[-1],
            columns=side.columns,
        )

    def _orthonormalize(self, plan: Plan) -> None:
        """Orthonormalise the factor ``plan`` multiplies with, in place: one batched call per class, on its
        contiguous block of the factor buffer (the smaller factors' zero padding stays zero)."""
        dtype, method = self.tuning.orthonormalize_dtype, self._orthonormalization
        for block, triangle in plan.classes:
            orthonormalize_(block, dtype=dtype, method=method, triangle=triangle)

    def _post(
        self, step: int, iteration: int, in_peers: list[tuple[int, float]] | None = None, shadow: bool = False
    ) -> _Round:
        """Iteration ``iteration`` of step ``step`` with ``in_peers`` (the schedule's, looked up when not given: a
        step's further iterations reuse its first's), multiplying the parameters or (``shadow``) their copy."""
        if in_peers is None:
            in_peers = self.schedule.peers(self.comm.rank, step).in_peers
        exact = bool(self._exact_numel) and (iteration == 0 or self.tuning.uncompressed_every_iteration)
        peers, planned, right = [], None, False
        for peer, weight in in_peers:
            edge = self.edge(peer)
            right = edge.iteration % 2 == 1  # the same for every peer of a round: edges advance in step
            plan = self._plan(peer, edge, right, exact)
            if shadow:
                plan = self._twin(edge, right, exact, plan)
            if not self.warm_start:
                for stack in plan.factor:
                    for factor in stack:
                        factor.copy_(edge.draw(factor.shape[-1], self.matrix_rank, self._device, self._dtype).mT)
            self._run(plan, "products", partial(self._products, plan))
            if exact:  # packed once per iteration; further peers' messages copy the first pack
                if peers:
                    plan.sent_exact.copy_(peers[0][3].sent_exact)
                else:
                    torch.cat(self._shadow_exact if shadow else self._exact_views, out=plan.sent_exact)
            planned = plan.exchange if planned is None else planned + plan.exchange
            peers.append((peer, weight, edge, plan))
        seq = step * self.num_iterations + iteration
        handle = self._exchange([], [], seq) if planned is None else self._start_planned(planned, seq)
        return _Round(step, seq, peers, handle, exact, right, shadow)

    def _twin(self, edge: EdgeState, right: bool, exact: bool, plan: Plan) -> Plan:
        """``plan`` on the copy of the parameters (:func:`twin_plan`), built on first use and kept with the edge's
        plans (so that setup, which clears them, drops it too)."""
        key = ("shadow", right, exact)
        twin = edge.plans.get(key)
        if twin is None:
            twin = edge.plans[key] = twin_plan(plan, self._shadow)
        return twin

    def _products(self, plan: Plan) -> None:
        """Orthonormalise the factor ``plan`` multiplies with and write its products into the message."""
        self._orthonormalize(plan)
        for factor, x, out in plan.products:
            torch.bmm(factor, x, out=out)
        if plan.rounded:
            plan.sent_products.copy_(plan.difference)

    def _update(self, plan: Plan, alpha: float, maybe_zero_column: bool | None) -> None:
        """X += alpha p q^T on every run of ``plan``, then R replaces the factors (the warm-start rule)."""
        for x, p, qt in plan.updates:
            x.baddbmm_(p, qt, alpha=alpha)
        replace_factors(plan.replaced, maybe_zero_column)

    def _run(self, plan: Plan, key: Hashable, sequence: Callable[[], None]) -> None:
        """Run ``sequence`` (``plan``'s kernels named ``key``) as a CUDA graph where they are captured, else now."""
        if self._captured is None:
            sequence()
        else:
            self._captured.run(plan.graphs, key, sequence)

    def _apply(self, round_: _Round) -> None:
        self._wait(round_.handle)
        me, gamma, peers = self.comm.rank, self.gamma, round_.peers
        on_device = self.deferred_nonfinite_check and self.nonfinite == "raise"
        if on_device:  # checked on the device, read at the next step (before R is written over a message)
            dropped = self._nonfinite_peers(round_.step, self.nonfinite, [(p, plan.inboxes) for p, _, _, plan in peers])
        for peer, _, _, plan in peers:
            self._run(plan, ("difference", me < peer), partial(self._difference, plan, me < peer))
        maybe_zero_columns: dict[int, bool] = {}  # per peer, when known on the host
        skipped: set[int] = set()  # edges whose R is not finite from this rank's own products
        if not on_device:
            dropped, skipped = self._check_on_host(round_, maybe_zero_columns)
        # Uncompressed tensors: exact gossip, from the values at the start of the iteration (the packed tail of
        # every message sent; the sends are complete, so the first one's tail is mixed in place and copied back).
        if round_.exact and peers:
            kept = [(weight, plan.received_exact) for peer, weight, _, plan in peers if peer not in dropped]
            first = peers[0][3]
            first.sent_exact.mul_(1.0 - gamma * sum(weight for weight, _ in kept))
            for weight, incoming in kept:
                first.sent_exact.add_(incoming, alpha=gamma * weight)
            torch._foreach_copy_(self._shadow_exact if round_.shadow else self._exact_views, first.sent_exact_parts)
        # Matrices: equal and opposite low-rank corrections on the two ends of every edge, one batch per run.
        for peer, weight, edge, plan in peers:
            if peer not in dropped and peer not in skipped and self.groups:
                alpha = (1.0 if me < peer else -1.0) * gamma * weight
                # U = R q^T (or p R^T) from R itself: a zero column moves nothing, whatever warm factor it keeps.
                maybe_zero = maybe_zero_columns.get(peer)
                update = partial(self._update, plan, alpha, maybe_zero)
                if maybe_zero is None:  # decided on the device: the same kernels at every step
                    self._run(plan, ("update", alpha), update)
                else:
                    update()
            edge.iteration += 1  # a dropped peer: p and q stay as they were, the parity keeps step with the peer's

    def _difference(self, plan: Plan, low_end: bool) -> None:
        """R = a_hi - a_lo into ``plan.difference``, laid out as the factors it replaces (``plan.replaced``); this
        rank is the edge's low end or not. Identical on both ends from the same two operands: written over the
        received products, or, from products rounded to a narrower message dtype, computed in the parameters'
        dtype from the two exactly widened (a copy, then a subtraction whose operands type promotion widens;
        torch.sub of the two would subtract in the narrow dtype). Both run on the message as one piece, which is
        cheaper than per group into the padded layout, even with the copy into it that follows."""
        if not self.groups:
            return
        if low_end:
            high, low = plan.received_products, plan.sent_products
        else:
            high, low = plan.sent_products, plan.received_products
        if plan.rounded:
            plan.difference.copy_(high).sub_(low)
        else:
            torch.sub(high, low, out=plan.difference)
        replaced = plan.replaced
        if replaced.stored:
            torch._foreach_copy_(replaced.stored, replaced.sources)  # laid out as the factors (the padding stays 0)

    def _check_on_host(self, round_: _Round, maybe_zero_columns: dict[int, bool]) -> tuple[set[int], set[int]]:
        """The non-finite check and the warm-start rule's question, from one host read per peer (see
        :func:`column_sums`): a NaN or Inf among a peer's products is one in R (a_hi - a_lo), among its
        uncompressed tensors one in their sum; a sum that is not finite is checked exactly before anything is
        reported (finite elements can overflow a sum). Fills ``maybe_zero_columns`` (peer: whether a column of R
        sums to 0). Returns the peers whose values are dropped under ``nonfinite`` (after its error or warning),
        and the peers whose edge's correction is skipped because R is not finite from this rank's own products
        (its replica diverged, or a product overflowed a float16 message): ``"raise"`` raises, naming this rank,
        ``"drop"`` warns and skips that correction, so that its own parameters stay as they are."""
        me, step, bad, own = self.comm.rank, round_.step, [], set()
        for peer, _, _, plan in round_.peers:
            replaced = plan.replaced
            columns = replaced.columns
            sums = column_sums(replaced, plan.received_exact if round_.exact else None)
            maybe_zero_columns[peer] = 0.0 in sums[:columns]
            if math.isfinite(sum(sums)):
                continue
            if not all_finite_on_host([replaced.incoming]):
                if all_finite_on_host([plan.sent_products]):
                    bad.append(peer)
                else:
                    own.add(peer)
            if round_.exact and peer not in bad and not all_finite_on_host([plan.received_exact]):
                bad.append(peer)
        if not (bad or own):
            return set(), own
        for peer in sorted(own):
            message = (
                f"rank {me}: step {step}: this rank's own products for peer {peer} are not finite (NaN or Inf): its "
                f"replica has diverged{self._nonfinite_hint()}"
            )
            if self.nonfinite == "raise":
                raise NonFiniteError(message)
            warnings.warn(f"{message}; the correction of that edge is skipped", NonFiniteWarning, stacklevel=4)
        return self._refuse_nonfinite(step, self.nonfinite, bad), own

    # -- the Algorithm interface ----------------------------------------------------------------------------
    @property
    def _dtype(self) -> torch.dtype:
        return self.buckets[0].buffer.dtype

    @property
    def _device(self) -> torch.device:
        return self.buckets[0].buffer.device

    def _nonfinite_hint(self) -> str:
        if self.message_dtype != torch.float16:
            return ""
        return (
            "; or a product overflowed PowerGossip's float16 messages (largest finite value 65504): "
            "message_dtype=torch.bfloat16 keeps float32's range"
        )

    @property
    def _message_dtype(self) -> torch.dtype:
        """The dtype the products travel in: ``message_dtype``, or the parameters' when it is None."""
        return self.message_dtype or self._dtype

    def _start_step(self, step: int) -> _Round:
        return self._post(step, 0)

    def progress(self, pending: _Round, wait: bool = False) -> bool:
        """Run the open step's next power iterations whose previous exchange has arrived (``wait``: all of them).

        With ``num_iterations`` >= 2 (and ``tuning.iterations_during_backward``, without
        ``delayed_last_iteration``): when iteration k's exchange has completed (``Handle.done()``), its result is
        applied to a copy of the parameters (filled from x_t the first time) and iteration k + 1's products are
        taken from that copy and posted, so that its exchange overlaps what runs until ``finish`` (backward).
        ``finish`` applies what is still in flight, runs the iterations not started yet, all on the copy, and
        writes the copy into the buckets. The same kernels run on the same values in the same order as in
        ``finish`` without it, so the parameters and factors are bit for bit the same (module docstring,
        "Iterations during backward"). A round holding a NaN or Inf is left to ``finish``, which raises or warns
        as without progress. With ``wait`` every further iteration is posted, waiting for the exchanges before it
        (:meth:`gossip.Algorithm.progress` says why), also where ``tuning`` turns the iterations during backward
        off: the ranks may differ in that setting, and a peer may have posted them.

        Args:
            pending: what :meth:`start` returned for the open step.
            wait: post every further iteration, waiting for each previous exchange.

        Returns:
            Whether a later call may still make progress this step (False: none is needed before ``finish``).
        """
        allowed = self._progresses or (wait and self._may_progress)  # wait: also when the switch is off here
        if not allowed or not isinstance(pending, _Round) or not pending.peers:
            return False
        ahead = self._ahead
        if ahead is None:
            in_peers = [(peer, weight) for peer, weight, _, _ in pending.peers]
            ahead = self._ahead = _Ahead(pending.step, in_peers, [pending])
        while not ahead.stopped and len(ahead.rounds) < self.num_iterations:
            last = ahead.rounds[-1]
            if not last.handle.done():
                if not wait:
                    return True
                self._wait(last.handle)
            if not self._finite_on_host(last):
                ahead.stopped = True  # finish applies it, raising or warning where it would without progress
                break
            if ahead.applied == 0:
                self._fill_shadow()
                last = ahead.rounds[0] = self._on_shadow(last)
            self._apply(last)
            ahead.applied += 1
            ahead.rounds.append(self._post(ahead.step, len(ahead.rounds), ahead.in_peers, shadow=True))
            self.posted_ahead += 1
        return False

    @property
    def _may_progress(self) -> bool:
        """Whether further iterations may be posted before ``finish``: there are some, and none is delayed."""
        return self.num_iterations > 1 and not self.delayed_last_iteration

    @property
    def _progresses(self) -> bool:
        """Whether :meth:`progress` runs iterations ahead of ``finish`` when it need not wait (see there)."""
        return self._may_progress and self.tuning.iterations_during_backward

    def _finite_on_host(self, round_: _Round) -> bool:
        """Whether ``round_``'s received messages and own products are finite; True without a look where the
        non-finite check runs on the device (it raises at the next step either way)."""
        if self.deferred_nonfinite_check and self.nonfinite == "raise":
            return True
        return all_finite_on_host([t for _, _, _, plan in round_.peers for t in (*plan.inboxes, plan.sent_products)])

    def _fill_shadow(self) -> None:
        """Copy x_t into the copy of the parameters (allocated on first use)."""
        if self._shadow is None:
            self._shadow = Shadow(self.buckets)
            self._shadow_exact = [self._shadow.view(view) for view in self._exact_views]
        self._shadow.fill()

    def _on_shadow(self, round_: _Round) -> _Round:
        """``round_`` (posted on the parameters) with plans that update the copy instead."""
        peers = [(p, w, edge, self._twin(edge, round_.right, round_.exact, plan)) for p, w, edge, plan in round_.peers]
        return dataclasses.replace(round_, peers=peers, shadow=True)

    def _finish_step(self, pending: _Round) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.applied:  # iterations ran during backward: the rest on the copy too
            for round_ in ahead.rounds[ahead.applied :]:
                self._apply(round_)
            for iteration in range(len(ahead.rounds), self.num_iterations):
                self._apply(self._post(ahead.step, iteration, ahead.in_peers, shadow=True))
            self._shadow.write_back()
            return
        if self._delayed is not None:  # the previous step's last iteration; its exchange overlapped this step
            delayed, self._delayed = self._delayed, None
            self._apply(delayed)
        self._apply(pending)
        in_peers = [(peer, weight) for peer, weight, _, _ in pending.peers]
        for iteration in range(1, self.num_iterations):
            round_ = self._post(pending.step, iteration, in_peers)
            if iteration == self.num_iterations - 1 and self.delayed_last_iteration:
                self._delay(round_)
            else:
                self._apply(round_)

    def _delay(self, round_: _Round) -> None:
        """Keep ``round_`` to apply at the next step's finish, but for the edges the next step uses (applied now)."""
        following = {peer for peer, _ in self.schedule.peers(self.comm.rank, round_.step + 1).in_peers}
        now = [entry for entry in round_.peers if entry[0] in following]
        later = [entry for entry in round_.peers if entry[0] not in following]
        if now:
            self._apply(dataclasses.replace(round_, peers=now))
        self._delayed = dataclasses.replace(round_, peers=later) if later else None

    def drain(self) -> None:
        """Complete the delayed last iteration's exchange, if any, and drop it (every rank does, at close)."""
        if self._delayed is not None:
            delayed, self._delayed = self._delayed, None
            self._wait(delayed.handle)
            for _, _, edge, _ in delayed.peers:
                edge.iteration += 1  # as applied: the parity keeps step with the peer's

    def in_flight_state(self) -> dict:
        """The delayed last iteration's messages, after waiting for its exchange; empty when none is delayed.

        Returns:
            ``{"step", "seq", "right", "peers": [(peer, weight, sent messages, received messages)]}`` or ``{}``.
        """
        delayed = self._delayed
        if delayed is None:
            return {}
        self._wait(delayed.handle)
        return {
            "step": delayed.step,
            "seq": delayed.seq,
            "right": delayed.right,
            "peers": [
                (peer, weight, [t.clone() for t in plan.messages], [t.clone() for t in plan.inboxes])
                for peer, weight, _, plan in delayed.peers
            ],
        }

    def load_in_flight_state(self, state: dict) -> None:
        """Restore :meth:`in_flight_state` (after :meth:`load_state_dict`), to apply at the next finish.

        The delayed iteration is then applied as in the run that saved it. A delayed exchange of this run is
        completed and dropped first.

        Args:
            state: what :meth:`in_flight_state` returned.
        """
        self.drain()
        if not state:
            return
        peers = []
        for peer, weight, sent, received in state["peers"]:
            edge = self.edge(peer)
            plan = self._plan(peer, edge, bool(state["right"]), False)
            for into, saved in zip([*plan.messages, *plan.inboxes], [*sent, *received], strict=True):
                into.copy_(saved)
            peers.append((peer, weight, edge, plan))
        self._delayed = _Round(state["step"], state["seq"], peers, CompletedHandle(), False, bool(state["right"]))

    def state_dict(self) -> dict:
        """Every edge's factors, iteration counter and generator state (copies), with the config they belong to.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        return {
            "config": self.config(),
            "edges": {
                key: {
                    "iteration": e.iteration,
                    "p": [t.clone() for t in e.p],  # copies: the factors change in place as training goes on
                    "q": [t.clone() for t in e.q],
                    "generator": e.generator.get_state(),
                }
                for key, e in self.edges.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the edges :meth:`state_dict` returned.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: the state was saved with another config.
        """
        if state.get("config") != self.config():
            raise InvalidArgumentError(
                f"PowerGossip state was saved with {state.get('config')}, this run uses {self.config()}"
            )
        self.edges = {}
        for key, saved in state["edges"].items():
            generator = torch.Generator()
            generator.set_state(saved["generator"])
            p, q = ([t.to(self._device) for t in saved[side]] for side in ("p", "q"))
            self.edges[tuple(key)] = EdgeState(
                groups=self.groups,
                layout=self._layout(),
                generator=generator,
                iteration=saved["iteration"],
                p=p,
                q=q,
                dtype=self._dtype,
                device=self._device,
            )

    def config(self) -> dict:
        """The settings every rank must share, with ``tuning``'s except ``pad_ratio`` (it changes only the rounding).

        Returns:
            Setting name -> value.
        """
        config = {
            "rank": self.matrix_rank,
            "num_iterations": self.num_iterations,
            "gamma": self.gamma,
            "warm_start": self.warm_start,
            "min_compression": self.min_compression,
            "seed": self.seed,
            "orthonormalize_dtype": str(self.tuning.orthonormalize_dtype),
            "orthonormalization": str(self.tuning.orthonormalization),
            "uncompressed_every_iteration": self.tuning.uncompressed_every_iteration,
            "message_dtype": str(self.message_dtype),
        }
        if self.delayed_last_iteration:  # only when on, so that the default's config (and checkpoints) stay as before
            config["delayed_last_iteration"] = True
        return config
