"""Who talks to whom at step t, with which weights: gossip schedules, their validation and analysis.

Pure numpy + networkx. ``import topologies; s = topologies.one_peer_hypercube(8); s.peers(rank, t)``.
"""

from topologies.analysis import (
    ConsensusRate,
    bytes_per_step,
    exact_averaging_starts,
    expected_consensus_rate,
    noise_floor,
    optimal_overrelaxation,
    period_product,
    period_rho,
    rho,
    simulate_consensus,
    spectral_gap,
    step_gaps,
    step_rhos,
    steps_to_consensus,
)
from topologies.finite_time import base_graph
from topologies.peer_view import PeerView
from topologies.registry import by_name, names
from topologies.schedule import Schedule, ScheduleError
from topologies.static import (
    complete,
    erdos_renyi,
    from_edge_list,
    from_matrix,
    from_networkx,
    hypercube,
    random_regular,
    ring,
    star,
    static_exponential,
    torus,
)
from topologies.time_varying import (
    alternating_exp_ring,
    cyclic,
    hierarchical,
    one_peer_exponential,
    one_peer_hypercube,
    one_peer_ring,
    random_matchings,
)

__all__ = [
    "ConsensusRate",
    "PeerView",
    "Schedule",
    "ScheduleError",
    "alternating_exp_ring",
    "base_graph",
    "by_name",
    "bytes_per_step",
    "complete",
    "cyclic",
    "erdos_renyi",
    "exact_averaging_starts",
    "expected_consensus_rate",
    "from_edge_list",
    "from_matrix",
    "from_networkx",
    "hierarchical",
    "hypercube",
    "names",
    "noise_floor",
    "one_peer_exponential",
    "one_peer_hypercube",
    "one_peer_ring",
    "optimal_overrelaxation",
    "period_product",
    "period_rho",
    "random_matchings",
    "random_regular",
    "rho",
    "ring",
    "simulate_consensus",
    "spectral_gap",
    "star",
    "static_exponential",
    "step_gaps",
    "step_rhos",
    "steps_to_consensus",
    "torus",
]
