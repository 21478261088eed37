"""Communication cost formulas of the runtime model (docs/design.md B.5, E.2): seconds to move M bytes.

A reconstruction after Wang et al. (arXiv 2410.11998); the paper's own equations were not available, see B.5.
alpha = one-way latency (s), beta = 1 / bandwidth (s/B), M = bytes, n ranks, L = ``local_size`` ranks per node.

Link assumptions, stated once:
- Ranks are node-major (rank = node * L + local). Links inside a node use (intra_latency, intra_bandwidth) per
  rank; every node has ONE uplink of ``bandwidth_Bps`` to the other nodes, shared equally by the node's ranks
  that cross nodes at the same time (several NICs per node: pass their sum). Links are full duplex.

experiments.runtime_model turns these times into per-iteration predictions (compute, stragglers, overlap).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from topologies import Schedule


class RuntimeModelError(ValueError):
    """Bad input to the runtime model; the message names the argument (and row) at fault."""


def require_positive(name: str, value: float) -> float:
    """``value`` as a float; RuntimeModelError naming ``name`` unless it is a positive finite number."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise RuntimeModelError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def require_fraction(name: str, value: float) -> float:
    """``value`` as a float; RuntimeModelError naming ``name`` unless 0 <= value <= 1."""
    if not 0.0 <= value <= 1.0:
        raise RuntimeModelError(f"{name} must lie in [0, 1], got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Network:
    """One link class (local_size=1) or two: inside a node and between nodes (the per-node uplink)."""

    latency_s: float
    bandwidth_Bps: float
    intra_latency_s: float | None = None
    intra_bandwidth_Bps: float | None = None
    local_size: int = 1

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not math.isfinite(self.latency_s):
            raise RuntimeModelError(f"Network latency_s must be >= 0, got {self.latency_s!r}")
        require_positive("Network bandwidth_Bps", self.bandwidth_Bps)
        if self.intra_latency_s is not None and self.intra_latency_s < 0:
            raise RuntimeModelError(f"Network intra_latency_s must be >= 0, got {self.intra_latency_s!r}")
        if self.intra_bandwidth_Bps is not None:
            require_positive("Network intra_bandwidth_Bps", self.intra_bandwidth_Bps)
        if not isinstance(self.local_size, int) or self.local_size < 1:
            raise RuntimeModelError(f"Network local_size must be an integer >= 1, got {self.local_size!r}")

    @property
    def intra_alpha(self) -> float:
        return self.latency_s if self.intra_latency_s is None else self.intra_latency_s

    @property
    def intra_bandwidth(self) -> float:
        return self.bandwidth_Bps if self.intra_bandwidth_Bps is None else self.intra_bandwidth_Bps

    def check_ranks(self, n: int) -> None:
        if not isinstance(n, int) or n < 2 or n % self.local_size:
            raise RuntimeModelError(f"n={n!r} ranks must be an integer >= 2 divisible by local_size={self.local_size}")


def _inter(network: Network) -> tuple[float, float]:
    """(alpha, bandwidth) of the inter-node uplink."""
    return network.latency_s, network.bandwidth_Bps


# ---------------------------------------------------------------- cost primitives (B.5, E.2)
def ring_allreduce_time(message_bytes: float, ranks: int, latency_s: float, bandwidth_Bps: float) -> float:
    """T_AR(M, p) = 2(p-1) alpha + 2(p-1)/p * M * beta (B.5); 0 for p = 1."""
    p = ranks
    return 2 * (p - 1) * latency_s + 2 * (p - 1) / p * message_bytes / bandwidth_Bps


def allreduce_cost(message_bytes: float, ranks: int, latency_s: float, bandwidth_Bps: float, algorithm: str) -> float:
    """``"ring"``: T_AR of B.5 (Gloo's ring). ``"best"``: for p = 2^K also recursive halving-doubling (Rabenseifner;
    Thakur et al. 2005, MPI/NCCL-like), 2 log2(p) alpha + 2(p-1)/p M beta -- same bytes, O(log p) latency."""
    if algorithm not in ("ring", "best"):
        raise RuntimeModelError(f"allreduce algorithm={algorithm!r} must be 'ring' or 'best'")
    ring = ring_allreduce_time(message_bytes, ranks, latency_s, bandwidth_Bps)
    if algorithm == "ring" or ranks & (ranks - 1):
        return ring
    return ring - 2 * (ranks - 1 - math.log2(ranks)) * latency_s


def pair_exchange_time(message_bytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """T_pair(M) = alpha + M * beta: send M and receive M at once over a full-duplex link (B.5)."""
    return latency_s + message_bytes / bandwidth_Bps


def shared_uplink_time(message_bytes: float, degree: int, latency_s: float, bandwidth_Bps: float) -> float:
    """alpha + d * M * beta: d messages of M leave through one shared uplink (sent concurrently, one alpha)."""
    return latency_s + degree * message_bytes / bandwidth_Bps if degree > 0 else 0.0


def hierarchical_allreduce_time(
    message_bytes: float, per_node: int, nodes: int, network: Network, algorithm: str = "ring"
) -> float:
    """Intra reduce-scatter + inter all-reduce of M/l + intra all-gather, l = ``per_node`` (B.5, E.2):
    2(l-1) alpha_intra + 2(l-1)/l M beta_intra + 2(k-1) alpha + 2(k-1)/k M beta, k = ``nodes`` (the l ranks of a
    node share its uplink, so M/l each at bandwidth B/l). Equals T_AR(M, k) when l = 1."""
    intra = allreduce_cost(message_bytes, per_node, network.intra_alpha, network.intra_bandwidth, algorithm)
    return intra + allreduce_cost(message_bytes, nodes, *_inter(network), algorithm)


def group_allreduce_time(
    message_bytes: float, ranks: Iterable[int], network: Network, algorithm: str = "best"
) -> float:
    """Best of flat ring and hierarchical all-reduce of M over the group ``ranks`` (B.5, E.2).

    With g ranks on k nodes, l = g / k per node (node-major ring):
      flat ring:     2(g-1) * max(alpha + M/g * beta, alpha_intra + M/g * beta_intra)   (k > 1; one edge per node
                     leaves the node, so the uplink is not shared)
      hierarchical:  hierarchical_allreduce_time(M, l, k)
    With "best", a pair (g = 2) is a pairwise exchange, alpha + M beta. Both forms equal T_AR(M, g) when l = 1.
    ``algorithm="best"``: the faster of the two forms, each ring stage with halving-doubling when it is faster
    (allreduce_cost). ``algorithm="ring"``: the flat ring only, as Gloo runs it (it has no hierarchical
    all-reduce): with l > 1 the hierarchical form, faster by up to a factor 2(g-1)/g / (2(k-1)/k) at the same
    uplink, is a different algorithm.
    """
    members = sorted(set(int(r) for r in ranks))
    g = len(members)
    if g <= 1:
        return 0.0
    nodes = {r // network.local_size for r in members}
    k = len(nodes)
    alpha, bandwidth = _inter(network) if k > 1 else (network.intra_alpha, network.intra_bandwidth)
    if g == 2 and algorithm == "best":
        return pair_exchange_time(message_bytes, alpha, bandwidth)
    per_node = g // k
    hierarchical = hierarchical_allreduce_time(message_bytes, per_node, k, network, algorithm)
    if k == 1:
        return hierarchical
    chunk = message_bytes / g
    flat_step = max(alpha + chunk / bandwidth, network.intra_alpha + chunk / network.intra_bandwidth)
    flat = 2 * (g - 1) * flat_step if per_node > 1 else allreduce_cost(message_bytes, g, alpha, bandwidth, algorithm)
    return flat if algorithm == "ring" else min(flat, hierarchical)


def allreduce_time(model_bytes: float, n: int, network: Network, algorithm: str = "best") -> float:
    """All-Reduce of the model over all n ranks: group_allreduce_time over range(n)."""
    network.check_ranks(n)
    return group_allreduce_time(model_bytes, range(n), network, algorithm)


def gossip_step_times(
    schedule: Schedule, t: int, network: Network, message_bytes: float, algorithm: str = "best"
) -> np.ndarray:
    """Per-rank communication time (s) of step t of ``schedule``, shape (n,).

    A step that partitions ranks into exact-averaging groups larger than 2 (AER, hierarchical, complete) is a
    group all-reduce per group (Decent-DP). Otherwise every rank sends ``message_bytes`` to each out-peer:
    intra-node peers over its own link (alpha_intra + d_intra M beta_intra), inter-node peers through the
    node's shared uplink (alpha + B_node beta, B_node = the node's inter-node bytes, max of sent and received);
    the two link classes run concurrently.
    """
    n, size = schedule.n, network.local_size
    groups = schedule.groups(t)
    times = np.zeros(n)
    if groups is not None and max(len(g) for g in groups) > 2:
        for group in groups:
            times[list(group)] = group_allreduce_time(message_bytes, group, network, algorithm)
        return times
    node = np.arange(n) // size
    counts = np.zeros((4, n))  # intra out, intra in, inter out, inter in
    for r in range(n):
        view = schedule.peers(r, t)
        for row, peers in ((0, view.out_peers), (1, view.in_peers)):
            for j, _ in peers:
                counts[row + (2 if node[j] != node[r] else 0), r] += 1
    node_bytes = message_bytes * np.maximum(np.bincount(node, counts[2]), np.bincount(node, counts[3]))[node]
    inter = np.where(node_bytes > 0, network.latency_s + node_bytes / network.bandwidth_Bps, 0.0)
    intra_degree = counts[:2].max(axis=0)
    intra = np.where(intra_degree > 0, network.intra_alpha + intra_degree * message_bytes / network.intra_bandwidth, 0)
    return np.maximum(inter, intra)


def hierarchical_gossip_time(
    model_bytes: float, nodes: int, network: Network, inter_bytes: float | None = None
) -> tuple[float, float]:
    """(blocking intra-node s, overlappable inter-node s) of one HierarchicalGossip step (E.2), L = local_size.

    As gossip.algorithms.hierarchical implements it: the reduce-scatter (in ``start``) and the all-gather (in
    ``finish``) are each ONE exchange in which a rank sends (L-1)/L of M to its L-1 node mates at once:
        T_rs = T_ag = alpha_intra + (L-1)/L * M * beta_intra          (0 when L = 1)
    (a ring would pay (L-1) alpha_intra per phase for the same bytes). Between nodes, local rank l swaps its M/L
    shard with local rank l of the partner node; the L ranks share the node's uplink, so it carries
    ``inter_bytes`` (default M, exact; the PowerGossip factors of the whole model when compressed):
        T_inter = alpha + inter_bytes * beta                          (0 when nodes = 1)
    """
    per_node = network.local_size
    one_phase = network.intra_alpha + (per_node - 1) / per_node * model_bytes / network.intra_bandwidth
    inter_bytes = model_bytes if inter_bytes is None else inter_bytes
    inter = shared_uplink_time(inter_bytes / per_node, per_node, *_inter(network)) if nodes > 1 else 0.0
    return (2 * one_phase if per_node > 1 else 0.0), inter
