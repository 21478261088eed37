"""PowerGossip: gossip of model differences through a rank-r projection both ends of an edge share.

Vogels, Karimireddy, Jaggi, "PowerGossip: Practical Low-Rank Communication Compression in Decentralized Deep
Learning", NeurIPS 2020 (arXiv 2008.01425); algorithms.md section A. For an edge lo < hi with weight w and a
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
compute R from the same two operands, and orthonormalize identical inputs with identical code (in float64,
which also absorbs kernel differences between devices, A.4). Factors of an idle edge are kept, so warm starts
survive time-varying schedules that revisit pairs (A.8). Tensors with fewer than two dimensions and matrices
whose compression ratio m k / (r (m + k)) is below ``min_compression`` travel uncompressed, mixed as exact
gossip (A.5, D.3); ``policy`` overrides the choice per parameter name. Parameters with 0 elements travel as
nothing.

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


def orthonormalize(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns, in float64; deterministic, so equal inputs give equal outputs."""
    work = matrix.to(torch.float64)
    for c in range(work.shape[1]):
        column = work[:, c]
        column.div_(torch.linalg.vector_norm(column) + eps)
        if c + 1 < work.shape[1]:
            rest = work[:, c + 1 :]
            rest.sub_(torch.outer(column, column @ rest))
    return work.to(matrix.dtype)


def keep_direction(product: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The new warm factor: ``product``, except that an all-zero column keeps ``previous``'s column.

    A zero column of R = a_hi - a_lo means the two models did not differ along the projection (identical
    replicas: the first step after the initial broadcast, or right after a global average). Taken as the next
    projection it would orthonormalise to zero, and the edge would send zeros for that column forever; the
    previous factor still spans a useful direction. Both ends hold the same R and the same previous factor, so
    they choose alike; the choice is made on the device (no host sync).
    """
    nonzero = product.abs().amax(dim=0, keepdim=True) > 0
    return torch.where(nonzero, product, previous)


@dataclass(frozen=True)
class _Matrix:
    """A compressed parameter: bucket index, entry, and its matrix shape (m, k)."""

    bucket: int
    entry: Entry
    m: int
    k: int


class EdgeState:
    """Warm factors and the parity counter of one unordered pair, identical on both of its ends."""

    __slots__ = ("generator", "iteration", "p", "q")

    def __init__(self, seed: int, matrices: list[_Matrix], rank: int, device: torch.device, dtype: torch.dtype):
        self.generator = torch.Generator().manual_seed(seed)
        self.iteration = 0
        self.p: list[torch.Tensor] = []
        self.q: list[torch.Tensor] = []
        for matrix in matrices:
            self.p.append(self.draw(matrix.m, rank, device, dtype))
            self.q.append(self.draw(matrix.k, rank, device, dtype))

    def draw(self, rows: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(rows, rank, generator=self.generator, dtype=dtype).to(device)


@dataclass
class _Round:
    step: int
    seq: int
    peers: list[tuple[int, float, EdgeState, bool]]  # peer, weight, edge, right multiplication?
    sent: list[torch.Tensor]  # per peer: the packed products
    received: list[torch.Tensor]
    received_exact: list[list[torch.Tensor]]  # per peer, per uncompressed entry
    handle: Handle


class PowerGossip(Algorithm):
    """Low-rank gossip of model differences with warm-started, per-edge shared projections."""

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
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerGossip: rank must be an integer >= 1, got {rank!r}")
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, int) or num_iterations < 1:
            raise ValueError(f"PowerGossip: num_iterations must be an integer >= 1, got {num_iterations!r}")
        if not gamma > 0:
            raise ValueError(f"PowerGossip: gamma must be positive, got {gamma}")
        if not min_compression >= 1:
            raise ValueError(f"PowerGossip: min_compression must be >= 1 (a ratio), got {min_compression}")
        self.rank, self.num_iterations, self.gamma = rank, num_iterations, float(gamma)
        self.warm_start, self.min_compression, self.policy, self.seed = warm_start, min_compression, policy, seed
        self.nonfinite = check_nonfinite_policy("PowerGossip", nonfinite)
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
            return m * k / (self.rank * (m + k)) >= self.min_compression
        if choice and len(shape) < 2:
            raise ValueError(f"PowerGossip policy: parameter {entry.name!r} of shape {tuple(shape)} is not a matrix")
        if choice and min(shape[0], shape.numel() // shape[0]) < self.rank:
            raise ValueError(
                f"PowerGossip: rank {self.rank} is larger than parameter {entry.name!r} of shape {tuple(shape)} "
                f"allows (at most {min(shape[0], shape.numel() // shape[0])})"
            )
        return bool(choice)

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        if schedule is None:
            raise ValueError("PowerGossip needs a schedule (e.g. topologies.one_peer_hypercube(n))")
        super().setup(comm, schedule, buckets)
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
            self.edges[key] = EdgeState(self.seed * n * n + lo * n + hi, self.matrices, self.rank, device, dtype)
        return self.edges[key]

    def _matrix(self, matrix: _Matrix) -> torch.Tensor:
        return self.buckets[matrix.bucket].view(matrix.entry).reshape(matrix.m, matrix.k)

    def _exact(self, index: int, entry: Entry) -> torch.Tensor:
        return self.buckets[index].buffer[entry.offset : entry.offset + entry.numel]

    # -- one power iteration --------------------------------------------------------------------------------
    def _post(self, step: int, iteration: int) -> _Round:
        view = self.schedule.peers(self.comm.rank, step)
        peers, sent, received, received_exact, sends, recvs = [], [], [], [], [], []
        for peer, weight in view.in_peers:
            edge = self.edge(peer)
            right = edge.iteration % 2 == 1
            sizes = [(m.m if right else m.k) * self.rank for m in self.matrices]
            message = torch.empty(sum(sizes), dtype=self._dtype, device=self._device)
            offset = 0
            for i, (matrix, size) in enumerate(zip(self.matrices, sizes, strict=True)):
                x, out = self._matrix(matrix), message[offset : offset + size].view(-1, self.rank)
                factors = edge.q if right else edge.p
                if not self.warm_start:
                    factors[i] = edge.draw(factors[i].shape[0], self.rank, self._device, self._dtype)
                factors[i] = orthonormalize(factors[i])
                torch.mm(x, factors[i], out=out) if right else torch.mm(x.T, factors[i], out=out)
                offset += size
            exact_in = [torch.empty_like(self._exact(i, e)) for i, e in self.exact]
            sends += [(peer, message)] + [(peer, self._exact(i, e)) for i, e in self.exact]
            recvs += [(peer, incoming := torch.empty_like(message))] + [(peer, t) for t in exact_in]
            peers.append((peer, weight, edge, right))
            sent.append(message)
            received.append(incoming)
            received_exact.append(exact_in)
            nbytes = message.numel() * message.element_size() + sum(t.numel() * t.element_size() for t in exact_in)
            self.traffic.record(peer, nbytes, nbytes)
        seq = step * self.num_iterations + iteration
        handle = self.comm.exchange(sends, recvs, seq=seq)
        return _Round(step, seq, peers, sent, received, received_exact, handle)

    def _apply(self, round_: _Round) -> None:
        self._wait(round_.handle)
        me, gamma = self.comm.rank, self.gamma
        received = [
            (peer, [message, *exact])
            for (peer, _, _, _), message, exact in zip(
                round_.peers, round_.received, round_.received_exact, strict=True
            )
        ]
        dropped = self._nonfinite_peers(round_.step, self.nonfinite, received)
        # Uncompressed tensors: exact gossip, from the values at the start of the iteration.
        kept = [
            (w, incoming)
            for (p, w, _, _), incoming in zip(round_.peers, round_.received_exact, strict=True)
            if p not in dropped
        ]
        keep = 1.0 - gamma * sum(weight for weight, _ in kept)
        for slot, (index, entry) in enumerate(self.exact):
            x = self._exact(index, entry)
            x.mul_(keep)
            for weight, incoming in kept:
                x.add_(incoming[slot], alpha=gamma * weight)
        # Matrices: equal and opposite low-rank corrections on the two ends of every edge.
        for (peer, weight, edge, right), own, theirs in zip(round_.peers, round_.sent, round_.received, strict=True):
            if peer in dropped:
                edge.iteration += 1  # keep the parity in step with the peer's; p and q stay as they were
                continue
            lo = me < peer
            offset = 0
            for i, matrix in enumerate(self.matrices):
                size = (matrix.m if right else matrix.k) * self.rank
                a_own = own[offset : offset + size].view(-1, self.rank)
                a_peer = theirs[offset : offset + size].view(-1, self.rank)
                difference = a_peer - a_own if lo else a_own - a_peer  # a_hi - a_lo on both ends
                alpha = (1.0 if lo else -1.0) * gamma * weight
                # U = R q^T (or p R^T) from R itself: a zero column moves nothing, whatever warm factor it keeps.
                if right:
                    self._matrix(matrix).addmm_(difference, edge.q[i].T, alpha=alpha)
                    edge.p[i] = keep_direction(difference, edge.p[i])
                else:
                    self._matrix(matrix).addmm_(edge.p[i], difference.T, alpha=alpha)
                    edge.q[i] = keep_direction(difference, edge.q[i])
                offset += size
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
            edge = EdgeState.__new__(EdgeState)
            edge.generator = torch.Generator()
            edge.generator.set_state(saved["generator"])
            edge.iteration = saved["iteration"]
            edge.p = [t.to(self._device) for t in saved["p"]]
            edge.q = [t.to(self._device) for t in saved["q"]]
            self.edges[tuple(key)] = edge

    def config(self) -> dict:
        return {
            "rank": self.rank,
            "num_iterations": self.num_iterations,
            "gamma": self.gamma,
            "warm_start": self.warm_start,
            "min_compression": self.min_compression,
            "seed": self.seed,
        }
