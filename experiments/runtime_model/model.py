"""Per-iteration runtime model: All-Reduce (DDP) vs decentralized gossip training (docs/design.md B.5, E.2).

A reconstruction after Wang et al. (arXiv 2410.11998); the paper's own equations were not available, see B.5.
Notation (alpha, beta, M, n, L) and link assumptions: experiments.runtime_model.costs, which holds the cost formulas.

Assumptions, stated once:
- Compute time C_i(t) of a forward+backward is lognormal with mean ``compute_s`` and coefficient of variation
  ``compute_cv``, i.i.d. over ranks and steps (as in docs/design.md B.5).
- All-Reduce (DDP): bucketed all-reduce overlapped with the backward pass (``backward_fraction`` = 2/3 of
  compute), of which a fraction ``overlap`` = 0.5 hides communication (the last buckets start only when the
  backward ends; 0.5 reproduces B.5's table). T_AR uses the faster of ring and halving-doubling
  (``allreduce_algorithm="best"``) or the ring alone ("ring", as Gloo). Every step is a global barrier:
      T_AR_iter = E[max_n C] + max(0, T_AR(M, n) - overlap * backward_fraction * E[max_n C]) + U
- Decentralized: x^t is communicated during the whole forward+backward of step t (``overlap`` = 1.0):
      T_dec_iter = E[max_{|R|+1} C] + max(0, T_gossip - overlap * E[max_{|R|+1} C]) + U
  A rank waits only for its |R| in-peers, not for all n (B.5 factor iii).
- Straggler term: ``straggler="quadrature"`` (default): E[max of k i.i.d. lognormals] by quadrature, k = n for
  All-Reduce, |R|+1 for gossip. It ignores slack (a peer lagging by less than C - T_gossip costs nothing: too
  high) and delays spreading over several steps (too low on static graphs); the two agree with the Monte Carlo
  within ~5% at cv <= 0.3. ``straggler="montecarlo"``: the seeded max-plus recursion of B.5, f_i(t) =
  max(f_i(t-1) + C_i, max_{j in R_i(t)} f_j(t-1) + T_i(t) + (1 - overlap) C_i) + U; mean slope of max_i f_i.
- Hierarchical gossip (``algorithm="hierarchical_gossip"``, gossip.algorithms.hierarchical, E.2): a blocking
  intra-node reduce-scatter before compute and all-gather after it, and only the inter-node exchange overlapped:
      T_hier_iter = E[max_{2L} C] + T_rs + max(0, T_inter - overlap * E[max_{2L} C]) + T_ag + U
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

import topologies
from experiments.runtime_model.costs import (
    Network,
    RuntimeModelError,
    allreduce_time,
    gossip_step_times,
    hierarchical_gossip_time,
    require_fraction,
    require_positive,
    shared_uplink_time,
)
from topologies import Schedule

ALGORITHMS = ("allreduce", "exact", "powergossip", "hierarchical_gossip")
NODE_SCHEDULES = ("alternating_exp_ring", "hierarchical")  # need local_size >= 2 (ranks grouped by node)


# ---------------------------------------------------------------- compute-time statistics
@functools.lru_cache(maxsize=256)
def expected_max_compute(mean_s: float, cv: float, k: int) -> float:
    """E[max of k i.i.d. lognormal compute times] with mean ``mean_s`` and coefficient of variation ``cv``.

    C = mean * exp(s Z - s^2/2), s^2 = ln(1 + cv^2); max is monotone in Z, so
    E[max] = mean * integral exp(s z - s^2/2) k phi(z) Phi(z)^(k-1) dz (trapezoid rule on z in [-10, 10]).
    """
    if cv == 0.0 or k <= 1:
        return mean_s
    s = math.sqrt(math.log1p(cv * cv))
    z = np.linspace(-10.0, 10.0, 8001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    density = k * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * cdf ** (k - 1)
    return mean_s * float(np.trapezoid(np.exp(s * z - 0.5 * s * s) * density, z))


def _lognormal(rng: np.random.Generator, mean_s: float, cv: float, size: tuple[int, int]) -> np.ndarray:
    s2 = math.log1p(cv * cv)
    return mean_s * rng.lognormal(-0.5 * s2, math.sqrt(s2), size=size)


# ---------------------------------------------------------------- per-iteration predictions
@dataclasses.dataclass(frozen=True)
class IterationPrediction:
    """Predicted mean time of one training iteration (seconds) and its parts; total = sum of the parts."""

    algorithm: str
    n: int
    compute_s: float  # mean forward+backward
    straggler_s: float  # waiting for the slowest of the ranks one waits for
    exposed_comm_s: float  # communication not hidden behind compute
    optimizer_s: float
    comm_s: float  # communication time, hidden or not (mean over one schedule period)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.straggler_s + self.exposed_comm_s + self.optimizer_s


def allreduce_iteration(
    compute_s: float,
    allreduce_s: float,
    n: int,
    *,
    compute_cv: float = 0.0,
    overlap: float = 0.5,
    backward_fraction: float = 2 / 3,
    optimizer_s: float = 0.0,
) -> IterationPrediction:
    """T = E[max_n C] + max(0, T_AR - overlap * backward_fraction * E[max_n C]) + U (B.5), from T_AR directly."""
    slowest = expected_max_compute(compute_s, compute_cv, n)
    exposed = max(0.0, allreduce_s - require_fraction("overlap", overlap) * backward_fraction * slowest)
    return IterationPrediction("allreduce", n, compute_s, slowest - compute_s, exposed, optimizer_s, allreduce_s)


def gossip_iteration(
    compute_s: float,
    gossip_s: float | Sequence[float],
    peers: int | Sequence[int],
    n: int,
    *,
    compute_cv: float = 0.0,
    overlap: float = 1.0,
    optimizer_s: float = 0.0,
    algorithm: str = "exact",
) -> IterationPrediction:
    """T = mean_t [E[max_{|R_t|+1} C] + max(0, T_gossip(t) - overlap * E[max_{|R_t|+1} C])] + U (B.5).

    ``gossip_s`` and ``peers`` (|R_t|, the in-peers a rank waits for) are scalars or one value per step.
    """
    comm, waited = np.broadcast_arrays(np.asarray(gossip_s, float), np.asarray(peers, int))
    slowest = np.array([expected_max_compute(compute_s, compute_cv, int(k) + 1) for k in waited.ravel()])
    exposed = np.maximum(0.0, comm.ravel() - require_fraction("overlap", overlap) * slowest)
    straggler, exposed_mean = float(slowest.mean()) - compute_s, float(exposed.mean())
    return IterationPrediction(algorithm, n, compute_s, straggler, exposed_mean, optimizer_s, float(comm.mean()))


def _schedule_for(schedule_or_degree: Schedule | str, n: int, network: Network) -> Schedule:
    if isinstance(schedule_or_degree, Schedule):
        schedule_or_degree.require_size(n)
        return schedule_or_degree
    options = {"per_node": network.local_size} if schedule_or_degree in NODE_SCHEDULES else {}
    return topologies.by_name(schedule_or_degree, n, **options)


def _simulate(compute_s, cv, comm, in_peers, overlap, optimizer_s, steps, seed, barrier_backward=None) -> float:
    """Seeded max-plus recursion (B.5); ``barrier_backward`` set = All-Reduce with a global barrier."""
    rng = np.random.default_rng(seed)
    draws = _lognormal(rng, compute_s, cv, (steps, comm.shape[1]))
    if barrier_backward is not None:
        slowest = draws.max(axis=1)
        exposed = np.maximum(0.0, comm[0, 0] - overlap * barrier_backward * slowest)
        return float(np.mean(slowest + exposed)) + optimizer_s
    finish = np.zeros(comm.shape[1])
    for t in range(steps):
        phase = t % comm.shape[0]
        start = finish[in_peers[phase]].max(axis=1)  # in_peers includes the rank itself
        finish = np.maximum(finish + draws[t], start + comm[phase] + (1 - overlap) * draws[t]) + optimizer_s
    return float(finish.max() / steps)


def predict_iteration(
    compute_s: float,
    network: Network,
    model_bytes: float,
    n: int,
    schedule_or_degree: Schedule | str | int | None,
    algorithm: str,
    *,
    message_bytes: float | None = None,
    overlap: float | None = None,
    compute_cv: float = 0.0,
    optimizer_s: float = 0.0,
    backward_fraction: float = 2 / 3,
    straggler: str = "quadrature",
    allreduce_algorithm: str = "best",
    steps: int = 400,
    seed: int = 0,
) -> IterationPrediction:
    """Predicted per-iteration time of ``algorithm`` in ALGORITHMS (module docstring).

    ``schedule_or_degree``: a Schedule, a topologies name, or an int d (every rank sends to d peers on other
    nodes each step: alpha + L d M beta through the shared uplink); ignored for "allreduce" and
    "hierarchical_gossip" (always topologies.hierarchical(n / local_size, local_size)).
    ``message_bytes``: bytes per peer per step; exact gossip defaults to ``model_bytes``, PowerGossip needs it
    (e.g. topologies.bytes_per_step(schedule, shapes, "powergossip", rank=r) / out-degree). For
    "hierarchical_gossip": bytes a node sends to its partner node per step (default ``model_bytes``, exact;
    the PowerGossip message of the whole model for HierarchicalGossip(compress_rank=r)).
    ``overlap``: defaults 0.5 of the backward (allreduce) and 1.0 of forward+backward (gossip).
    ``allreduce_algorithm``: "best" (ring or halving-doubling, for All-Reduce and group steps) or "ring" (Gloo).
    """
    if algorithm not in ALGORITHMS:
        raise RuntimeModelError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
    require_positive("compute_s", compute_s)
    require_positive("model_bytes", model_bytes)
    if compute_cv < 0 or optimizer_s < 0:
        raise RuntimeModelError(f"compute_cv and optimizer_s must be >= 0, got {compute_cv=}, {optimizer_s=}")
    if straggler not in ("quadrature", "montecarlo"):
        raise RuntimeModelError(f"straggler={straggler!r} must be 'quadrature' or 'montecarlo'")
    network.check_ranks(n)
    common = {"compute_cv": compute_cv, "optimizer_s": optimizer_s}
    if algorithm == "hierarchical_gossip":
        options = {"straggler": straggler, "steps": steps, "seed": seed, **common}
        return _hierarchical_iteration(compute_s, network, model_bytes, n, message_bytes, overlap, **options)
    if algorithm == "allreduce":
        overlap = 0.5 if overlap is None else overlap
        t_ar = allreduce_time(model_bytes, n, network, allreduce_algorithm)
        result = allreduce_iteration(compute_s, t_ar, n, overlap=overlap, backward_fraction=backward_fraction, **common)
        if straggler == "montecarlo":
            comm = np.full((1, n), t_ar)
            total = _simulate(compute_s, compute_cv, comm, None, overlap, optimizer_s, steps, seed, backward_fraction)
            result = _with_total(result, total)
        return result
    if message_bytes is None:
        if algorithm == "powergossip":
            raise RuntimeModelError("algorithm='powergossip' needs message_bytes (bytes per peer per step)")
        message_bytes = model_bytes
    require_positive("message_bytes", message_bytes)
    overlap = 1.0 if overlap is None else overlap
    comm, in_peers = _gossip_plan(schedule_or_degree, n, network, message_bytes, algorithm, allreduce_algorithm)
    waited = [p.shape[1] - 1 for p in in_peers]
    result = gossip_iteration(compute_s, comm.max(axis=1), waited, n, overlap=overlap, algorithm=algorithm, **common)
    if straggler == "montecarlo":
        result = _with_total(
            result, _simulate(compute_s, compute_cv, comm, in_peers, overlap, optimizer_s, steps, seed)
        )
    return result


def _hierarchical_iteration(
    compute_s, network, model_bytes, n, inter_bytes, overlap, *, straggler, steps, seed, compute_cv, optimizer_s
) -> IterationPrediction:
    """HierarchicalGossip. Quadrature: a rank waits for the 2L ranks of its node and the partner node (L for one
    node), without slack (an upper bound); "montecarlo": _simulate_hierarchical (slack across nodes only)."""
    nodes = n // network.local_size
    try:
        topologies.hierarchical(nodes, network.local_size)  # nodes must be a power of two
    except ValueError as err:
        raise RuntimeModelError(f"hierarchical_gossip with n={n}, local_size={network.local_size}: {err}") from err
    if inter_bytes is not None:
        require_positive("message_bytes", inter_bytes)
    blocking, inter = hierarchical_gossip_time(model_bytes, nodes, network, inter_bytes)
    waited = (2 if nodes > 1 else 1) * network.local_size - 1
    overlap = 1.0 if overlap is None else overlap
    options = {"compute_cv": compute_cv, "optimizer_s": optimizer_s, "overlap": overlap}
    result = gossip_iteration(compute_s, inter, waited, n, algorithm="hierarchical_gossip", **options)
    result = dataclasses.replace(
        result, exposed_comm_s=result.exposed_comm_s + blocking, comm_s=result.comm_s + blocking
    )
    if straggler == "montecarlo":
        args = (compute_s, compute_cv, nodes, network.local_size, blocking / 2, inter, overlap, optimizer_s)
        result = _with_total(result, _simulate_hierarchical(*args, steps, seed))
    return result


def _simulate_hierarchical(compute_s, cv, nodes, per_node, phase_s, inter_s, overlap, optimizer_s, steps, seed):
    """Seeded max-plus recursion of HierarchicalGossip's time line; mean seconds per step.

    Node u starts step t when its slowest rank ended step t-1, plus the reduce-scatter: s_u = max_u f + T_rs.
    The inter-node exchange with partner v ends at max(s_u, s_v) + T_inter; rank i is ready at
    max(s_u + C_i, that + (1 - overlap) C_i); the all-gather ends the step for the whole node:
    f_u = max over the node of ready + T_ag + U. Within a node there is no slack (two blocking phases).
    """
    rng = np.random.default_rng(seed)
    draws = _lognormal(rng, compute_s, cv, (steps, nodes * per_node)).reshape(steps, nodes, per_node)
    dims, node = max(nodes.bit_length() - 1, 1), np.arange(nodes)
    finish = np.zeros(nodes)
    for t in range(steps):
        start = finish + phase_s
        partner = node ^ (1 << (t % dims)) if nodes > 1 else node
        exchanged = np.maximum(start, start[partner]) + inter_s
        ready = np.maximum(start[:, None] + draws[t], exchanged[:, None] + (1 - overlap) * draws[t])
        finish = ready.max(axis=1) + phase_s + optimizer_s
    return float(finish.max() / steps)


def _gossip_plan(schedule_or_degree, n, network, message_bytes, algorithm, allreduce_algorithm):
    """Per-step per-rank comm times (steps, n) and padded in-peer arrays for one period."""
    if isinstance(schedule_or_degree, int) and not isinstance(schedule_or_degree, bool):
        if schedule_or_degree < 1:
            raise RuntimeModelError(f"degree must be >= 1, got {schedule_or_degree}")
        degree = schedule_or_degree
        uplink = shared_uplink_time(
            message_bytes, network.local_size * degree, network.latency_s, network.bandwidth_Bps
        )
        comm = np.full((1, n), uplink)
        return comm, [np.column_stack([np.arange(n)] + [(np.arange(n) + k + 1) % n for k in range(degree)])]
    if schedule_or_degree is None:
        raise RuntimeModelError(f"algorithm={algorithm!r} needs a schedule name, Schedule or degree")
    schedule = _schedule_for(schedule_or_degree, n, network)
    if algorithm == "powergossip" and not schedule.is_symmetric:
        raise RuntimeModelError(f"PowerGossip needs pairwise exchange; schedule '{schedule.name}' is not symmetric")
    steps = list(schedule.check_steps)
    if algorithm == "powergossip" and any(max(map(len, schedule.groups(t) or [()])) > 2 for t in steps):
        raise RuntimeModelError(f"PowerGossip is pairwise; schedule '{schedule.name}' averages groups of > 2 ranks")
    comm = np.stack([gossip_step_times(schedule, t, network, message_bytes, allreduce_algorithm) for t in steps])
    return comm, [_padded_in_peers(schedule, t) for t in steps]


def _padded_in_peers(schedule: Schedule, t: int) -> np.ndarray:
    """(n, 1 + max in-degree) array: each rank followed by its in-peers, padded with the rank itself."""
    rows = [[r, *(j for j, _ in schedule.peers(r, t).in_peers)] for r in range(schedule.n)]
    width = max(len(row) for row in rows)
    return np.array([row + [row[0]] * (width - len(row)) for row in rows])


def _with_total(result: IterationPrediction, total_s: float) -> IterationPrediction:
    """Replace the straggler part by the Monte-Carlo remainder so that total_s equals the simulated mean."""
    remainder = total_s - result.compute_s - result.exposed_comm_s - result.optimizer_s
    return dataclasses.replace(result, straggler_s=remainder)
