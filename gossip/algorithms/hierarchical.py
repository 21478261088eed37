"""Hierarchical gossip: exact averaging inside a node, one-peer gossip between nodes (docs/design.md E.2).

With L ranks per node and N = 2^K nodes, ranks numbered node-major (rank = node * L + local rank), step t mixes

    x_i <- mean of the 2L ranks of node u and its partner node u' = u XOR 2^(t mod log2 N),

i.e. W(t) = W_node(t) kron (1/L) 1 1^T with W_node(t) the one-peer hypercube over nodes: the schedule
``topologies.hierarchical(N, L)`` (symmetric, doubly stochastic, exact global average after log2 N steps).
Every local rank carries 1/L of the model across the slow inter-node link (ZeRO++ hpZ/qgZ, Frontier E.1):

1. intra-node reduce-scatter (fast level): local rank j owns shard j of every bucket; every rank sends shard j
   to local rank j and sums the L contributions in local-rank order, then divides by L -> shard of the node
   mean. Each rank sends (L - 1)/L of the model and receives as much: the bandwidth-optimal volume of a
   reduce-scatter (a ring moves the same bytes in L - 1 hops; here it is one ``comm.exchange`` with L - 1
   peers, so it runs on every backend).
2. inter-node exchange (slow level, overlapped with forward and backward): local rank l swaps its shard with
   local rank l of the partner node and averages, (a + b) / 2 -- the same bits on both ends, since IEEE
   addition commutes. Each rank moves M / L bytes per step over the slow link.
3. intra-node all-gather (fast level): every rank sends its mixed shard to the other L - 1 local ranks.

``compress_rank=r`` compresses step 2 with PowerGossip (A, r columns): shards are then whole tensors (each
local rank owns complete matrices, assigned largest first to the least loaded local rank, and keeps per-pair
factors for them only), and the node means of the owned tensors are gossiped with the partner's same local
rank; tensors PowerGossip does not compress (1-D, small, ``policy``) travel exactly. The intra-node levels stay
exact, so the sum over ranks is preserved and all L ranks of a node end bit-identical.

Time line: ``start`` runs step 1 (blocking, fast level) and posts step 2; ``finish`` waits for step 2 and runs
step 3. ``wait_seconds`` counts all blocking. ``local_size`` defaults to the communicator's; pass it to
emulate nodes on one host (e.g. an MPI launch on one machine, or network namespaces).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import Bucket, Entry, pack
from gossip.algorithms.powergossip import Policy, PowerGossip
from gossip.backends.base import Communicator
from gossip.backends.comm_thread import Handle
from gossip.errors import ArgumentTypeError, InvalidArgumentError
from topologies import Schedule, hierarchical

PHASES = 3  # exchanges per step: reduce-scatter, inter-node, all-gather (their seq is PHASES * step + phase)


@dataclass
class _Pending:
    step: int
    partner: int | None
    owned: list[torch.Tensor]  # exact variant: this rank's shard of the node mean, per bucket
    received: list[torch.Tensor]
    handle: Handle | None
    inner: Any = None  # compressed variant: the inner PowerGossip's pending round


def inter_node_pairs(nodes: int, per_node: int) -> Schedule:
    """Local rank l of node u paired with local rank l of node u XOR 2^(t mod log2 nodes), weights 1/2.

    Disconnected on purpose (local ranks never mix with each other here): it is the slow level of the
    hierarchical step only, never a schedule on its own, so it is built without validation.

    Args:
        nodes: N, the number of nodes, a power of two.
        per_node: L, the ranks per node.

    Returns:
        The schedule of the inter-node pairs, period log2 N.
    """
    dims = max(nodes.bit_length() - 1, 1)
    ranks = np.arange(nodes * per_node)

    def step(phase: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        partner = ((ranks // per_node) ^ (1 << phase)) * per_node + ranks % per_node if nodes > 1 else ranks
        return np.concatenate([ranks, ranks]), np.concatenate([ranks, partner]), np.full(2 * ranks.size, 0.5)

    return Schedule(nodes * per_node, "hierarchical-inter", step, dims, validate=False)


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` contiguous shards of ``numel`` elements, sizes differing by at most one.

    Args:
        numel: the elements to split.
        parts: the number of shards.

    Returns:
        ``(start, stop)`` per shard, in order.
    """
    size, extra = divmod(numel, parts)
    bounds, start = [], 0
    for j in range(parts):
        stop = start + size + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def assign_whole_tensors(sizes: list[int], parts: int) -> list[int]:
    """Owner (0..parts-1) of each tensor: largest first to the least loaded part, ties to the lower index.

    Args:
        sizes: each tensor's elements.
        parts: the number of owners.

    Returns:
        Each tensor's owner, in the order of ``sizes``.
    """
    load = [0] * parts
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(parts), key=lambda j: (load[j], j))
        owner[index] = part
        load[part] += sizes[index]
    return owner


class HierarchicalGossip(Algorithm):
    """Exact intra-node averaging + one-peer inter-node gossip of 1/L shards, optionally PowerGossip-compressed.

    With ``compress_rank`` the compressing :class:`PowerGossip` is built here, from the constructor's arguments;
    :meth:`setup` binds it (:meth:`Algorithm.setup_part`) to the inter-node pairs, the slow level of the
    validated ``topologies.hierarchical`` schedule, on the local ranks that own tensors (``inner``; None
    elsewhere). Nothing of it is changed after that.

    Args:
        compress_rank: the PowerGossip rank of the inter-node level; None mixes it exactly.
        local_size: L, ranks per node; None takes the communicator's.
        min_compression: passed to the inner PowerGossip.
        policy: passed to the inner PowerGossip.
        seed: passed to the inner PowerGossip.

    Raises:
        InvalidArgumentError: ``compress_rank`` or ``local_size`` is neither None nor an integer >= 1.
    """

    name = "hierarchical"
    state_dict_is_snapshot = True  # its compressor's (a PowerGossip), or none
    needs_symmetric_schedule = True

    def __init__(
        self,
        compress_rank: int | None = None,
        *,
        local_size: int | None = None,
        min_compression: float = 2.0,
        policy: Policy | None = None,
        seed: int = 0,
    ):
        if compress_rank is not None and (
            isinstance(compress_rank, bool) or not isinstance(compress_rank, int) or compress_rank < 1
        ):
            raise InvalidArgumentError(
                f"HierarchicalGossip: compress_rank must be None or an integer >= 1, got {compress_rank!r}"
            )
        if local_size is not None and (
            isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1
        ):
            raise InvalidArgumentError(
                f"HierarchicalGossip: local_size must be None or an integer >= 1, got {local_size!r}"
            )
        self.compress_rank, self.local_size = compress_rank, local_size
        self.min_compression, self.policy, self.seed = min_compression, policy, seed
        # The part that compresses the inter-node level, built here; setup binds it where it has work.
        self._compressor = (
            None
            if compress_rank is None
            else PowerGossip(compress_rank, min_compression=min_compression, policy=policy, seed=seed)
        )
        self.inner: PowerGossip | None = None  # the compressor, once bound (None where this rank owns nothing)

    # -- binding --------------------------------------------------------------------------------------------
    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        """Bind; ``schedule`` must be ``topologies.hierarchical(N, L)`` or None (then it is built).

        Args:
            comm: this rank's communicator.
            schedule: ``topologies.hierarchical(N, L)`` for this world, or None.
            buckets: the parameter buckets to mix in place.

        Raises:
            InvalidArgumentError: L does not divide the world size, the ranks are not numbered node-major, or
                ``schedule`` is another schedule.
        """
        per_node = self.local_size if self.local_size is not None else comm.local_size
        if comm.size % per_node:
            raise InvalidArgumentError(
                f"rank {comm.rank}: HierarchicalGossip: local size {per_node} does not divide "
                f"the world size {comm.size}"
            )
        if self.local_size is None and comm.local_rank != comm.rank % per_node:
            raise InvalidArgumentError(
                f"rank {comm.rank}: HierarchicalGossip needs node-major rank numbering (rank = node * local_size + "
                f"local_rank), but local_rank is {comm.local_rank} with local_size {per_node}"
            )
        nodes = comm.size // per_node
        expected = hierarchical(nodes, per_node)  # raises naming `nodes` unless it is a power of two
        if schedule is None:
            schedule = expected
        elif schedule.fingerprint() != expected.fingerprint():
            raise InvalidArgumentError(
                f"rank {comm.rank}: HierarchicalGossip mixes as topologies.hierarchical({nodes}, {per_node}) "
                f"(local size {per_node}); got schedule {schedule!r}; pass that schedule or None"
            )
        super().setup(comm, schedule, buckets)
        self.per_node, self.nodes = per_node, nodes
        self.node, self.local = divmod(comm.rank, per_node)
        self.members = [self.node * per_node + j for j in range(per_node)]
        self.dims = nodes.bit_length() - 1
        if self.compress_rank is None:
            self.bounds = [shard_bounds(bucket.buffer.numel(), per_node) for bucket in buckets]
        else:
            self._setup_compressed(comm)

    def _setup_compressed(self, comm: Communicator) -> None:
        if len({bucket.buffer.dtype for bucket in self.buckets}) > 1:
            raise ArgumentTypeError(
                f"rank {comm.rank}: HierarchicalGossip(compress_rank=...) needs buckets of one dtype"
            )
        self.entries: list[tuple[int, Entry]] = [(i, e) for i, b in enumerate(self.buckets) for e in b.entries]
        self.owner = assign_whole_tensors([e.numel for _, e in self.entries], self.per_node)
        self.owned_by = [[k for k, o in enumerate(self.owner) if o == j] for j in range(self.per_node)]
        self.owned_numel = [sum(self.entries[k][1].numel for k in ks) for ks in self.owned_by]
        mine = self.owned_by[self.local]
        named = [(self.entries[k][1].name, self._entry(k).view(self.entries[k][1].shape)) for k in mine]
        self.inner_buckets = pack(named, bucket_bytes=sys.maxsize)
        if self.nodes > 1 and mine:
            # The slow level's pairing: a level of the schedule validated in setup, disconnected on its own.
            self.setup_part(self._compressor, inter_node_pairs(self.nodes, self.per_node), self.inner_buckets)
            self.inner = self._compressor

    def _entry(self, k: int) -> torch.Tensor:
        index, entry = self.entries[k]
        return self.buckets[index].buffer[entry.offset : entry.offset + entry.numel]

    def _pack_owned(self, j: int) -> torch.Tensor:
        parts = [self._entry(k) for k in self.owned_by[j]]
        return torch.cat(parts) if parts else self.buckets[0].buffer.new_empty(0)

    def describe(self) -> dict[str, Any]:
        """Who owns what: per local rank, the tensor names (compressed) or the shard bounds per bucket (exact).

        Returns:
            The ownership, with the inner PowerGossip's description when it compresses.
        """
        if self.compress_rank is None:
            return {"shards": self.bounds}
        owned = {j: [self.entries[k][1].name for k in ks] for j, ks in enumerate(self.owned_by)}
        return {"owned": owned, **({"inner": self.inner.describe()} if self.inner is not None else {})}

    def _partner(self, step: int) -> int | None:
        if self.nodes == 1:
            return None
        return (self.node ^ (1 << (step % self.dims))) * self.per_node + self.local

    # -- the three phases -----------------------------------------------------------------------------------
    def _swap(self, step: int, phase: int, sends: list, recvs: list) -> Handle:
        sends = [(p, t) for p, t in sends if t.numel()]
        recvs = [(p, t) for p, t in recvs if t.numel()]
        return self._exchange(sends, recvs, PHASES * step + phase)

    def _reduce_scatter(self, step: int, pieces: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """``pieces[b][j]`` goes to local rank j; return, per b, the mean over the node of this rank's piece.

        The L contributions are summed in local-rank order, so the result does not depend on the backend.
        """
        others = [j for j in range(self.per_node) if j != self.local]
        received = [{j: group[self.local].new_empty(group[self.local].numel()) for j in others} for group in pieces]
        sends = [(self.members[j], group[j]) for group in pieces for j in others]
        recvs = [(self.members[j], got[j]) for got in received for j in others]
        self._wait(self._swap(step, 0, sends, recvs))
        means = []
        for group, got in zip(pieces, received, strict=True):
            parts = [group[j] if j == self.local else got[j] for j in range(self.per_node)]
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            means.append(total.div_(self.per_node))
        return means

    def _all_gather(self, step: int, mine: list[torch.Tensor], targets: list[list[torch.Tensor]]) -> None:
        """Send ``mine[b]`` to every other local rank; receive local rank j's piece into ``targets[b][j]``."""
        others = [j for j in range(self.per_node) if j != self.local]
        sends = [(self.members[j], own) for own in mine for j in others]
        recvs = [(self.members[j], group[j]) for group in targets for j in others]
        handle = self._swap(step, 2, sends, recvs)
        for own, group in zip(mine, targets, strict=True):
            if group[self.local] is not own:
                group[self.local].copy_(own)
        self._wait(handle)

    def check_deferred(self) -> None:
        """Also the inner PowerGossip's deferred non-finite check (same step numbers)."""
        super().check_deferred()
        if self.inner is not None:
            self.inner.check_deferred()

    # -- the Algorithm interface ----------------------------------------------------------------------------
    def _start_step(self, step: int) -> _Pending:
        partner = self._partner(step)
        if self.compress_rank is not None:
            return self._start_compressed(step, partner)
        pieces = [[b.buffer[lo:hi] for lo, hi in bounds] for b, bounds in zip(self.buckets, self.bounds, strict=True)]
        owned, received = self._reduce_scatter(step, pieces), []
        handle = None
        if partner is not None:
            received = [torch.empty_like(t) for t in owned]
            handle = self._swap(step, 1, [(partner, t) for t in owned], [(partner, t) for t in received])
        return _Pending(step, partner, owned, received, handle)

    def _start_compressed(self, step: int, partner: int | None) -> _Pending:
        (mean,) = self._reduce_scatter(step, [[self._pack_owned(j) for j in range(self.per_node)]])
        if self.inner_buckets:
            self.inner_buckets[0].buffer.copy_(mean)
        inner = self.inner.start(step) if self.inner is not None else None
        return _Pending(step, partner, [], [], None, inner)

    def _finish_step(self, pending: _Pending) -> None:
        if self.compress_rank is not None:
            return self._finish_compressed(pending)
        if pending.handle is not None:
            self._wait(pending.handle)
            for own, theirs in zip(pending.owned, pending.received, strict=True):
                own.add_(theirs).mul_(0.5)  # a + b == b + a in IEEE: both nodes get the same bits
        targets = [[b.buffer[lo:hi] for lo, hi in bounds] for b, bounds in zip(self.buckets, self.bounds, strict=True)]
        self._all_gather(pending.step, pending.owned, targets)
        return None

    def _finish_compressed(self, pending: _Pending) -> None:
        if self.inner is not None:
            self.inner.finish(pending.inner)
        mine = self.inner_buckets[0].buffer if self.inner_buckets else self.buckets[0].buffer.new_empty(0)
        gathered = [mine if j == self.local else mine.new_empty(self.owned_numel[j]) for j in range(self.per_node)]
        self._all_gather(pending.step, [mine], [gathered])
        for j, flat in enumerate(gathered):
            offset = 0
            for k in self.owned_by[j]:
                target = self._entry(k)
                target.copy_(flat[offset : offset + target.numel()])
                offset += target.numel()

    # -- state ----------------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The settings every rank must share: ``compress_rank``, ``local_size``, ``min_compression``, ``seed``.

        Returns:
            Setting name -> value.
        """
        return {
            "compress_rank": self.compress_rank,
            "local_size": self.local_size,
            "min_compression": self.min_compression,
            "seed": self.seed,
        }

    def state_dict(self) -> dict[str, Any]:
        """The inner PowerGossip's state (its factors), or nothing when this rank keeps none.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        return {"inner": self.inner.state_dict()} if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: a non-empty state for a configuration that keeps none.
        """
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])
        elif state:
            raise InvalidArgumentError(f"HierarchicalGossip keeps no state in this configuration, got {sorted(state)}")
