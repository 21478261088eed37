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
(``blocks.#.mlp.fc.weight``) -- the layers of a transformer -- are one group with stacked factors. The products
and the update run as one ``bmm`` / ``baddbmm_`` per run of the group's layers lying at equal distances in one
bucket, a (count, m, k) strided view of the bucket without a copy (one run per bucket the layers span). Factors
of equal rows are orthonormalised together, and on CUDA also those within a factor ``pad_ratio`` (default
``PAD_RATIO``), the smaller ones zero-padded: one batched Gram-Schmidt per class (on a GPT on a GPU, every q in one
call), not per group. On the CPU, where the arithmetic rather than the launches dominates, padding would add work
(rows x r^2 per factor), so the default there is 1. The difference of the two ends'
products is one subtraction over the whole message. The uncompressed tensors of all buckets travel packed into
one message, packed with one ``cat`` of views taken at setup and unpacked with one ``_foreach_copy_``. So the
operations of a step -- on a GPU, kernel launches, whose fixed cost dominates at these sizes -- do not grow with
the number of layers or of uncompressed tensors, except for the runs (keep the layers in few buckets). No value
is read back to the host on the hot path: the non-finite check is deferred on CUDA (see gossip.algorithms.base).
Precision: ``orthonormalize_dtype`` (default None: float32, or float64 for float64 parameters). Householder QR is
backward stable, so float32 factors are orthonormal to about 1e-6 whatever their conditioning, and the precision
of the basis only shapes how well the projection captures X_hi - X_lo, never the invariants (both ends apply the
same correction with opposite signs); float64 costs two conversions per orthonormalisation. Either way both ends
run the same kernel on the same input, so they agree bit for bit; the choice is part of ``config()`` and so of
checkpoints.

Factors of an idle edge are kept, so warm starts survive time-varying schedules that revisit pairs (A.8).
Tensors with fewer than two dimensions and matrices whose compression ratio m k / (r (m + k)) is below
``min_compression`` travel uncompressed, mixed as exact gossip (A.5, D.3); ``policy`` overrides the choice per
parameter name. Parameters with 0 elements travel as nothing.

``nonfinite="drop"``: when a peer's products or uncompressed tensors hold NaN or Inf, this end skips that
edge's correction for the step (its uncompressed tensors' weight goes back to the self weight, so that row stays
stochastic) and keeps its factors p and q as they were. The edge's parity counter still advances, so both ends
keep multiplying on the same side (else the next messages would differ in shape). Once both ends send finite
products again, two iterations make their factors identical again (both compute R from the same two operands).
The peer still applies its own side of the edge, so the sum over ranks is not preserved that step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gossip.algorithms.base import Algorithm, check_nonfinite_policy
from gossip.backends.base import Communicator, Handle
from gossip.buckets import Bucket, Entry
from topologies import Schedule

Policy = Callable[[str, torch.Size], "bool | None"]


def exclude_names(*patterns: str) -> Policy:
    """A policy sending every parameter whose name matches one of the regular expressions uncompressed."""
    compiled = [re.compile(pattern) for pattern in patterns]
    return lambda name, shape: False if any(p.search(name) for p in compiled) else None


def orthonormalize(matrix: torch.Tensor, eps: float = 1e-8, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal columns spanning those of ``matrix`` (rows x r, or a batch ... x rows x r), computed in ``dtype``
    and returned in ``matrix.dtype``; a new tensor, ``matrix`` is left alone.

    As PyTorch's PowerSGD communication hook chooses (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.
    _orthogonalize``): for r <= 2 modified Gram-Schmidt -- column c divided by its norm (+ ``eps``, so a zero column
    stays zero and finite), then removed from the columns after it: a few kernels per column --, above that one
    batched Householder QR (``torch.linalg.qr``: LAPACK on the CPU, cuSOLVER on CUDA), whose cost hardly grows
    with r (at r = 4 about 5x cheaper than Gram-Schmidt's column loop on the CPU, see benchmarks/README.md). QR's
    columns are orthonormal even where the input's are zero or dependent (Householder completes the basis); its
    signs may differ from Gram-Schmidt's, which does not matter to PowerGossip (p and q flip together).
    Deterministic: equal inputs on the same device and thread count give equal outputs, which is what keeps both
    ends of an edge bit-identical.
    """
    if matrix.shape[-1] > 2:
        return torch.linalg.qr(matrix.to(dtype)).Q.to(matrix.dtype)
    work = matrix.to(dtype, copy=True)
    columns = work.shape[-1]
    for c in range(columns):
        column = work[..., c : c + 1]
        column.div_(torch.linalg.vector_norm(column, dim=-2, keepdim=True).add_(eps))
        if c + 1 < columns:
            rest = work[..., c + 1 :]
            rest.sub_(column * (column.mT @ rest))
    return work.to(matrix.dtype)


def keep_direction(product: torch.Tensor, previous: torch.Tensor, owner: torch.Tensor, columns: int) -> torch.Tensor:
    """The new warm factors: ``product``, except that a factor column that is zero throughout keeps ``previous``'s.

    ``product`` and ``previous`` are flat, laid out as a message: factors stored transposed (r x rows), one after
    the other, so each factor column is a contiguous segment; ``owner[i]`` is the segment (0 .. ``columns`` - 1)
    that element i belongs to. A zero column of R = a_hi - a_lo means the two models did not differ along the
    projection (identical replicas: the first step after the initial broadcast, or right after a global average).
    Taken as the next projection it would orthonormalise to a direction that knows nothing of the models (zero
    under Gram-Schmidt, silencing that column of the edge for good); the previous factor still spans a useful
    direction. Both ends hold the same R and the same previous factors, so they choose alike; the choice is made
    on the device (no host sync), for the factors of every group at once: one ``scatter_reduce_`` finds each
    column's largest magnitude, one ``where`` selects.
    """
    largest = product.new_zeros(columns).scatter_reduce_(0, owner, product.abs(), "amax")
    return torch.where((largest > 0).index_select(0, owner), product, previous)


@dataclass(frozen=True)
class _Matrix:
    """A compressed parameter: bucket index, entry, and its matrix shape (m, k)."""

    bucket: int
    entry: Entry
    m: int
    k: int


@dataclass(frozen=True)
class _Run:
    """``count`` matrices of one shape at ``offset``, ``offset + stride``, ... of one bucket: one strided view."""

    bucket: int
    offset: int
    stride: int
    count: int


@dataclass(frozen=True)
class _Group:
    """Matrices of one shape (m, k) and one role, batched: one batched Gram-Schmidt for their factors.

    ``members`` are indices into the algorithm's matrix list, in (bucket, offset) order; ``runs`` cover them in
    the same order, each a zero-copy (count, m, k) view of one bucket, so the products and the update take one
    ``bmm`` / ``baddbmm_`` per run (one per group when the layers share a bucket).
    """

    m: int
    k: int
    members: tuple[int, ...]
    runs: tuple[_Run, ...]


def group_matrices(matrices: list[_Matrix]) -> list[_Group]:
    """Batch ``matrices`` into groups of one shape and one role, without copying them.

    The role is the parameter name with its digits replaced (``blocks.3.mlp.fc.weight`` -> ``blocks.#.mlp.fc.
    weight``): in a stack of identical layers the same role sits at the same distance from one layer to the next,
    so the layers of a bucket form one run. A change of bucket or of spacing starts a new run of the same group.
    Groups are ordered by their first matrix, so every rank builds the same groups from the same model.
    """
    roles: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):
        roles.setdefault((matrix.m, matrix.k, re.sub(r"\d+", "#", matrix.entry.name)), []).append(index)
    groups: list[_Group] = []
    for (m, k, _), members in roles.items():
        members = sorted(members, key=lambda i: (matrices[i].bucket, matrices[i].entry.offset))
        runs: list[list[int]] = []
        for index in members:
            run = runs[-1] if runs else []
            offsets = [matrices[i].entry.offset for i in run]
            fits = run and matrices[run[0]].bucket == matrices[index].bucket
            fits = fits and (len(run) == 1 or matrices[index].entry.offset - offsets[-1] == offsets[1] - offsets[0])
            if fits:
                run.append(index)
            else:
                runs.append([index])
        described = []
        for run in runs:
            offsets = [matrices[i].entry.offset for i in run]
            stride = offsets[1] - offsets[0] if len(run) > 1 else m * k
            described.append(_Run(matrices[run[0]].bucket, offsets[0], stride, len(run)))
        groups.append(_Group(m, k, tuple(members), tuple(described)))
    return sorted(groups, key=lambda g: min(g.members))


PAD_RATIO = 4  # the default pad_ratio on CUDA


def row_classes(rows: list[int], pad_ratio: int = PAD_RATIO) -> list[tuple[int, list[int]]]:
    """Groups whose factors (``rows[i]`` x r each) one batched Gram-Schmidt orthonormalises together:
    ``(padded rows, group indices)`` per class.

    A class starts at the largest row count not yet taken and takes every group with at least 1/``pad_ratio`` of
    its rows; the smaller factors are zero-padded to the class's rows. Zero rows change neither a column's norm nor
    an inner product, and stay zero, so the padded Gram-Schmidt computes the same factors (up to the rounding of
    the longer sums) with one kernel sequence per class instead of one per group; ``pad_ratio`` bounds the work
    spent on the zeros. Deterministic in ``rows``, so both ends of an edge build the same classes.
    """
    classes: list[tuple[int, list[int]]] = []
    for index in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        if classes and rows[index] * pad_ratio >= classes[-1][0]:
            classes[-1][1].append(index)
        else:
            classes.append((rows[index], [index]))
    return [(top, sorted(members)) for top, members in classes]


class EdgeState:
    """Warm factors and the parity counter of one unordered pair, identical on both of its ends.

    The factors are stored per group, stacked and transposed: ``pt_stacks[g]`` is (count, r, m) for group g, p^T
    of each of its matrices, contiguous (so the products are q^T X^T and p^T X, whose small dimension r comes
    first: on the CPU about 2.5-4x faster than X q and X^T p, see benchmarks/README.md; and a column of p is a
    contiguous row). ``p`` and ``q`` give them per matrix as m x r and k x r (views, in matrix order) for
    inspection and checkpoints.
    """

    __slots__ = ("generator", "iteration", "members", "pt_stacks", "qt_stacks", "slots")

    def __init__(
        self,
        groups: list[_Group],
        generator: torch.Generator,
        iteration: int,
        p: list[torch.Tensor],
        q: list[torch.Tensor],
    ):
        self.generator, self.iteration = generator, iteration
        self.members = [group.members for group in groups]
        where = {i: (g, s) for g, members in enumerate(self.members) for s, i in enumerate(members)}
        self.slots = [where[i] for i in range(len(where))]  # matrix index -> (group, position in the group)
        self.set_factors(p, q)

    @classmethod
    def fresh(
        cls,
        seed: int,
        matrices: list[_Matrix],
        groups: list[_Group],
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> EdgeState:
        """Factors drawn from the pair-seeded generator: p then q, matrix by matrix (part of the protocol)."""
        generator = torch.Generator().manual_seed(seed)
        p, q = [], []
        for matrix in matrices:
            p.append(torch.randn(matrix.m, rank, generator=generator, dtype=dtype).to(device))
            q.append(torch.randn(matrix.k, rank, generator=generator, dtype=dtype).to(device))
        return cls(groups, generator, 0, p, q)

    def draw(self, rows: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(rows, rank, generator=self.generator, dtype=dtype).to(device)

    def set_factors(self, p: list[torch.Tensor], q: list[torch.Tensor]) -> None:
        """Replace the factors from per-matrix lists (matrix order)."""
        self.pt_stacks = [torch.stack([p[i].mT for i in members]) for members in self.members]
        self.qt_stacks = [torch.stack([q[i].mT for i in members]) for members in self.members]

    def _unstack(self, stacks: list[torch.Tensor]) -> list[torch.Tensor]:
        return [stacks[g][s].mT for g, s in self.slots]

    @property
    def p(self) -> list[torch.Tensor]:
        return self._unstack(self.pt_stacks)

    @property
    def q(self) -> list[torch.Tensor]:
        return self._unstack(self.qt_stacks)


@dataclass(frozen=True)
class _Layout:
    """The products part of a message for one side (right or left multiplication) at one rank r."""

    sizes: list[int]  # elements of each group's products: count x r x (m or k)
    products: int  # their sum; the uncompressed tensors follow
    owner: torch.Tensor  # for keep_direction: the factor column each element belongs to
    columns: int  # the number of factor columns (r per matrix)


@dataclass
class _Round:
    step: int
    seq: int
    peers: list[tuple[int, float, EdgeState, bool]]  # peer, weight, edge, right multiplication?
    sent: list[torch.Tensor]  # per peer: the message (products, then the uncompressed tensors packed)
    received: list[torch.Tensor]
    handle: Handle


class PowerGossip(Algorithm):
    """Low-rank gossip of model differences with warm-started, per-edge shared projections.

    ``rank`` (the constructor keyword, and the ``"rank"`` of :meth:`config`) is the rank r of the projection; the
    instance keeps it as ``matrix_rank``, so that it is never confused with the process rank ``comm.rank``.
    """

    name = "powergossip"
    needs_symmetric_schedule = True

    def __init__(
        self,
        rank: int = 1,
        num_iterations: int = 1,
        gamma: float = 1.0,
        *,
        warm_start: bool = True,
        min_compression: float = 2.0,
        policy: Policy | None = None,
        seed: int = 0,
        nonfinite: str = "raise",
        orthonormalize_dtype: torch.dtype | None = None,
        pad_ratio: int | None = None,
    ):
        if orthonormalize_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(
                "PowerGossip: orthonormalize_dtype must be None, torch.float32 or torch.float64, "
                f"got {orthonormalize_dtype!r}"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerGossip: rank must be an integer >= 1, got {rank!r}")
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, int) or num_iterations < 1:
            raise ValueError(f"PowerGossip: num_iterations must be an integer >= 1, got {num_iterations!r}")
        if not gamma > 0:
            raise ValueError(f"PowerGossip: gamma must be positive, got {gamma}")
        if not min_compression >= 1:
            raise ValueError(f"PowerGossip: min_compression must be >= 1 (a ratio), got {min_compression}")
        self.matrix_rank, self.num_iterations, self.gamma = rank, num_iterations, float(gamma)
        self.warm_start, self.min_compression, self.policy, self.seed = warm_start, min_compression, policy, seed
        self.nonfinite = check_nonfinite_policy("PowerGossip", nonfinite)
        self.orthonormalize_dtype = orthonormalize_dtype
        if pad_ratio is not None and (isinstance(pad_ratio, bool) or not isinstance(pad_ratio, int) or pad_ratio < 1):
            raise ValueError(f"PowerGossip: pad_ratio must be None or an integer >= 1, got {pad_ratio!r}")
        self.pad_ratio = pad_ratio
        self.edges: dict[tuple[int, int], EdgeState] = {}

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
            raise ValueError(f"PowerGossip policy: parameter {entry.name!r} of shape {tuple(shape)} is not a matrix")
        largest = self.largest_matrix_rank()
        if choice and min(shape[0], shape.numel() // shape[0]) < largest:
            raise ValueError(
                f"PowerGossip: rank {largest} is larger than parameter {entry.name!r} of shape {tuple(shape)} "
                f"allows (at most {min(shape[0], shape.numel() // shape[0])})"
            )
        return bool(choice)

    def largest_matrix_rank(self) -> int:
        """The largest projection rank this instance will use; :meth:`setup` compresses only the matrices that
        allow it at ``min_compression``. A subclass that changes the rank while training overrides it (its ladder's
        top rung), so that the set of compressed matrices never changes."""
        return self.matrix_rank

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        if schedule is None:
            raise ValueError("PowerGossip needs a schedule (e.g. topologies.one_peer_hypercube(n))")
        super().setup(comm, schedule, buckets)
        dtypes = {str(bucket.buffer.dtype).removeprefix("torch.") for bucket in buckets}
        if len(dtypes) > 1:
            raise TypeError(
                f"rank {comm.rank}: PowerGossip sends each step's factors in one message of one dtype, but the "
                f"parameters have dtypes {sorted(dtypes)}: convert the model to one dtype before wrapping "
                "(e.g. model.float()), or use ExactGossip, which mixes every dtype"
            )
        self.matrices: list[_Matrix] = []
        self.exact: list[tuple[int, Entry]] = []
        for index, bucket in enumerate(buckets):
            if not bucket.buffer.is_floating_point():
                raise TypeError(f"PowerGossip: bucket {index} holds {bucket.buffer.dtype}; parameters must be floats")
            for entry in bucket.entries:
                if self._compress(entry):
                    self.matrices.append(_Matrix(index, entry, entry.shape[0], entry.numel // entry.shape[0]))
                else:
                    self.exact.append((index, entry))
        self.groups = group_matrices(self.matrices)
        # The uncompressed tensors of all buckets travel packed behind the products (the entries are small:
        # biases, norms), so an iteration sends one message per peer, not one per tensor or bucket. Their flat
        # views are taken once here: packing is one ``cat``, unpacking one ``_foreach_copy_``.
        self._exact_views = [self._exact(index, entry) for index, entry in self.exact]
        self._exact_sizes = [entry.numel for _, entry in self.exact]
        self._exact_numel = sum(self._exact_sizes)
        self._views: list[list[tuple[slice, torch.Tensor]]] = []  # per group: (its members' slice, (count, m, k))
        self._run_counts: list[list[int]] = []  # per group: matrices per run, to split its stacks in one call
        for group in self.groups:
            views, start = [], 0
            for run in group.runs:
                buffer = buckets[run.bucket].buffer
                shape, strides = (run.count, group.m, group.k), (run.stride, group.k, 1)
                view = buffer.as_strided(shape, strides, buffer.storage_offset() + run.offset)
                views.append((slice(start, start + run.count), view))
                start += run.count
            self._views.append(views)
            self._run_counts.append([run.count for run in group.runs])
        self._transposed = [[x.mT for _, x in views] for views in self._views]  # X^T of each run, a view
        self._layouts: dict[tuple[bool, int], _Layout] = {}
        # Groups whose factors have similar rows are orthonormalised together, zero-padded (see row_classes):
        # right multiplications orthonormalise q (k rows), left ones p (m rows).
        on_cuda = any(bucket.buffer.is_cuda for bucket in buckets)
        pad_ratio = self.pad_ratio if self.pad_ratio is not None else PAD_RATIO if on_cuda else 1
        self._row_classes = {
            right: row_classes([g.k if right else g.m for g in self.groups], pad_ratio) for right in (False, True)
        }

    def describe(self) -> dict[str, list[str]]:
        """Which parameters are compressed and which travel exactly."""
        return {"compressed": [m.entry.name for m in self.matrices], "exact": [e.name for _, e in self.exact]}

    # -- per-edge state -------------------------------------------------------------------------------------
    def edge(self, peer: int) -> EdgeState:
        """The state of the edge to ``peer``, created on first use from the pair-seeded generator."""
        lo, hi = sorted((self.comm.rank, peer))
        key = (lo, hi)
        if key not in self.edges:
            n = self.comm.size
            dtype = self.buckets[0].buffer.dtype if self.buckets else torch.float32
            device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
            seed = self.seed * n * n + lo * n + hi
            self.edges[key] = EdgeState.fresh(seed, self.matrices, self.groups, self.matrix_rank, device, dtype)
        return self.edges[key]

    def _matrix(self, matrix: _Matrix) -> torch.Tensor:
        return self.buckets[matrix.bucket].view(matrix.entry).reshape(matrix.m, matrix.k)

    def _exact(self, index: int, entry: Entry) -> torch.Tensor:
        return self.buckets[index].buffer[entry.offset : entry.offset + entry.numel]

    def _runs(self, g: int, stack: torch.Tensor) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
        """``stack`` (group g's matrices along dim 0) cut into its runs: views, one call for all runs."""
        return [stack] if len(self._run_counts[g]) == 1 else stack.split(self._run_counts[g])

    # -- one power iteration --------------------------------------------------------------------------------
    def _orthonormalize_class(self, factors: list[torch.Tensor], rows: int, members: list[int]) -> None:
        """Orthonormalise the factors ``factors[g]`` (stored transposed, count x r x rows) of the groups
        ``members`` in one batched call, the smaller ones zero-padded to ``rows``; each ``factors[g]`` becomes a
        contiguous (count, r, rows) stack (a view of the result)."""
        dtype = self.orthonormalize_dtype or (torch.float64 if self._dtype == torch.float64 else torch.float32)
        if len(members) == 1:
            factors[members[0]] = orthonormalize(factors[members[0]].mT, dtype=dtype).mT.contiguous()
            return
        stacks = [factors[g] for g in members]
        counts = [len(stack) for stack in stacks]
        if all(stack.shape[-1] == rows for stack in stacks):
            together = torch.cat(stacks)
        else:
            together = stacks[0].new_zeros(sum(counts), self.matrix_rank, rows)
            for stack, part in zip(stacks, together.split(counts), strict=True):
                part[..., : stack.shape[-1]].copy_(stack)
        together = orthonormalize(together.mT, dtype=dtype).mT.contiguous()
        for g, stack, part in zip(members, stacks, together.split(counts), strict=True):
            factors[g] = part if part.shape[-1] == stack.shape[-1] else part[..., : stack.shape[-1]].contiguous()

    def _layout(self, right: bool) -> _Layout:
        """The message of a right (or left) multiplication at the current rank; built once per side and rank (a
        subclass may change the rank while training)."""
        key = (right, self.matrix_rank)
        if key not in self._layouts:
            r = self.matrix_rank
            sizes = [len(g.members) * (g.m if right else g.k) * r for g in self.groups]
            columns = [g.m if right else g.k for g in self.groups for _ in g.members for _ in range(r)]
            owner = torch.repeat_interleave(torch.arange(len(columns)), torch.tensor(columns, dtype=torch.long))
            self._layouts[key] = _Layout(sizes, sum(sizes), owner.to(self._device), len(columns))
        return self._layouts[key]

    def _post(self, step: int, iteration: int) -> _Round:
        view = self.schedule.peers(self.comm.rank, step)
        peers, sent, received, sends, recvs = [], [], [], [], []
        exact_numel = self._exact_numel
        for peer, weight in view.in_peers:
            edge = self.edge(peer)
            right = edge.iteration % 2 == 1
            layout = self._layout(right)
            # One message per peer: the products of every group, then the uncompressed tensors packed.
            message = torch.empty(layout.products + exact_numel, dtype=self._dtype, device=self._device)
            factors = edge.qt_stacks if right else edge.pt_stacks
            if not self.warm_start:
                for g, group in enumerate(self.groups):
                    rows = group.k if right else group.m
                    draws = [edge.draw(rows, self.matrix_rank, self._device, self._dtype) for _ in group.members]
                    factors[g] = torch.stack([draw.mT for draw in draws])
            for rows, members in self._row_classes[right]:
                self._orthonormalize_class(factors, rows, members)
            parts = message.split([*layout.sizes, exact_numel])
            for g, group in enumerate(self.groups):
                # (X q)^T = q^T X^T and (X^T p)^T = p^T X: count x r x (m or k), written into the message
                out = parts[g].view(len(group.members), self.matrix_rank, -1)
                operands = self._transposed[g] if right else [x for _, x in self._views[g]]
                for x, factor, product in zip(operands, self._runs(g, factors[g]), self._runs(g, out), strict=True):
                    torch.bmm(factor, x, out=product)
            if exact_numel:
                torch.cat(self._exact_views, out=parts[-1])
            sends.append((peer, message))
            recvs.append((peer, incoming := torch.empty_like(message)))
            peers.append((peer, weight, edge, right))
            sent.append(message)
            received.append(incoming)
        seq = step * self.num_iterations + iteration
        handle = self._exchange(sends, recvs, seq)
        return _Round(step, seq, peers, sent, received, handle)

    def _apply(self, round_: _Round) -> None:
        self._wait(round_.handle)
        me, gamma, exact_numel = self.comm.rank, self.gamma, self._exact_numel
        received = [(peer, [message]) for (peer, _, _, _), message in zip(round_.peers, round_.received, strict=True)]
        dropped = self._nonfinite_peers(round_.step, self.nonfinite, received)
        # Uncompressed tensors: exact gossip, from the values at the start of the iteration (the packed tail of
        # every message sent; the sends are complete, so the first one's tail is mixed in place and copied back).
        if exact_numel and round_.peers:
            kept = [
                (w, message[-exact_numel:])
                for (p, w, _, _), message in zip(round_.peers, round_.received, strict=True)
                if p not in dropped
            ]
            own = round_.sent[0][-exact_numel:].mul_(1.0 - gamma * sum(weight for weight, _ in kept))
            for weight, incoming in kept:
                own.add_(incoming, alpha=gamma * weight)
            torch._foreach_copy_(self._exact_views, list(own.split(self._exact_sizes)))
        # Matrices: equal and opposite low-rank corrections on the two ends of every edge, one batch per group.
        for (peer, weight, edge, right), own, theirs in zip(round_.peers, round_.sent, round_.received, strict=True):
            if peer in dropped or not self.groups:
                edge.iteration += 1  # keep the parity in step with the peer's; p and q stay as they were
                continue
            layout, r = self._layout(right), self.matrix_rank
            own, theirs = own[: layout.products], theirs[: layout.products]
            alpha = (1.0 if me < peer else -1.0) * gamma * weight
            # a_hi - a_lo on both ends, for all groups at once (elementwise: equal to the per-group differences)
            difference = theirs - own if me < peer else own - theirs  # R^T of every matrix, in the message's layout
            warm = edge.pt_stacks if right else edge.qt_stacks  # the side R replaces
            previous = torch.cat([stack.reshape(-1) for stack in warm])
            kept_factors = keep_direction(difference, previous, layout.owner, layout.columns)
            for g, (group, part, kept_part) in enumerate(
                zip(self.groups, difference.split(layout.sizes), kept_factors.split(layout.sizes), strict=True)
            ):
                # U = R q^T (or p R^T) from R itself: a zero column moves nothing, whatever warm factor it keeps.
                stack = part.view(len(group.members), r, -1)
                warm[g] = kept_part.view(stack.shape)
                pt, qt = (stack, edge.qt_stacks[g]) if right else (edge.pt_stacks[g], stack)
                runs = zip(self._views[g], self._runs(g, pt), self._runs(g, qt), strict=True)
                for (_, x), pt_run, qt_run in runs:
                    x.baddbmm_(pt_run.mT, qt_run, alpha=alpha)  # X += alpha p q^T
            edge.iteration += 1

    # -- the Algorithm interface ----------------------------------------------------------------------------
    @property
    def _dtype(self) -> torch.dtype:
        return self.buckets[0].buffer.dtype

    @property
    def _device(self) -> torch.device:
        return self.buckets[0].buffer.device

    def start(self, step: int) -> _Round:
        self._begin_step()
        return self._post(step, 0)

    def finish(self, pending: _Round) -> None:
        self._apply(pending)
        for iteration in range(1, self.num_iterations):
            self._apply(self._post(pending.step, iteration))

    def state_dict(self) -> dict:
        return {
            "config": self.config(),
            "edges": {
                key: {"iteration": e.iteration, "p": e.p, "q": e.q, "generator": e.generator.get_state()}
                for key, e in self.edges.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != self.config():
            raise ValueError(f"PowerGossip state was saved with {state.get('config')}, this run uses {self.config()}")
        self.edges = {}
        for key, saved in state["edges"].items():
            generator = torch.Generator()
            generator.set_state(saved["generator"])
            p, q = ([t.to(self._device) for t in saved[side]] for side in ("p", "q"))
            self.edges[tuple(key)] = EdgeState(self.groups, generator, saved["iteration"], p, q)

    def config(self) -> dict:
        return {
            "rank": self.matrix_rank,
            "num_iterations": self.num_iterations,
            "gamma": self.gamma,
            "warm_start": self.warm_start,
            "min_compression": self.min_compression,
            "seed": self.seed,
            "orthonormalize_dtype": str(self.orthonormalize_dtype),
        }
