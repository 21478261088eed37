"""One step of a schedule as data: the sparse mixing matrix W(t) and what one rank sees of it.

Mixing semantics (docs/design.md F): x_i <- sum_j W_ij(t) x_j, so rank i receives x_j from every in-peer j
(W_ij > 0) and sends x_i to every out-peer j (W_ji > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: W(t) in coordinate form: (rows, cols, weights), W[rows[k], cols[k]] = weights[k].
Triplets = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class PeerView:
    """What one rank needs for one gossip step: its self weight and whom it receives from and sends to.

    Attributes:
        rank: the rank this view is for.
        step: the step t.
        self_weight: W[rank, rank], the weight the rank gives its own x.
        in_peers: (j, W[rank, j]) for j != rank with W[rank, j] > 0, sorted by j: rank receives x_j.
        out_peers: (j, W[j, rank]) for j != rank with W[j, rank] > 0, sorted by j: rank sends x_rank to j.
    """

    rank: int
    step: int
    self_weight: float
    in_peers: tuple[tuple[int, float], ...]
    out_peers: tuple[tuple[int, float], ...]
