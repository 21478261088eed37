"""The spectrum of replica differences in the learning-per-step study: how much of a difference a rank-r projection
can capture at best (Eckart-Young), and how much PowerGossip's own warm-started factor captures. Used by
:mod:`experiments.learning_per_step`."""

from __future__ import annotations

import math

import torch

import gossip
from gossip.algorithms.base import Algorithm

SPECTRUM_RANKS = (1, 4, 16)


def capture_shares(difference: torch.Tensor, ranks: tuple[int, ...] = SPECTRUM_RANKS) -> tuple[list[float], float]:
    """Energy share of ``difference`` that its best rank-r approximation keeps, per r, and its stable rank.

    share_r = sum_{k<r} s_k^2 / sum_k s_k^2 (Eckart-Young: the largest share any rank-r projection can capture);
    stable rank = ||D||_F^2 / ||D||_2^2, between 1 (rank one) and min(m, k) (flat spectrum).
    """
    singular = torch.linalg.svdvals(difference.to(torch.float64))
    energy = singular.square()
    total = float(energy.sum())
    if total == 0.0:
        return [1.0 for _ in ranks], 1.0
    cumulative = energy.cumsum(0)
    shares = [float(cumulative[min(r, len(energy)) - 1]) / total for r in ranks]
    return shares, total / float(energy[0])


def spectrum_rows(
    name: str, seed: int, step: int, replicas: list[dict[str, torch.Tensor]], algorithm: Algorithm | None
) -> list[dict]:
    """Rows for configuration ``name``: rank-r capture and stable rank of the replica differences, summed over the
    weight matrices by energy (share = sum over matrices of captured energy / total energy), for three differences:

    * ``pair``: X_0 - X_1;
    * ``to_mean``: X_0 - mean_i X_i;
    * ``next_edge`` (PowerGossip only): X_p - X_0 for rank 0's peer p of the next step, with ``pg_captured`` the
      energy share that edge's warm-started factor (orthonormalised by the exchange already posted) captures:
      ||D Q||^2 / ||D||^2 (right multiplication) or ||D^T P||^2 / ||D||^2 (left) -- what the next power
      iteration removes, against the best rank-r share in ``share_r<r>``.
    """
    rows = []
    mean = {name: torch.stack([r[name] for r in replicas]).mean(0) for name in replicas[0]}
    differences = [("pair", replicas[1], None), ("to_mean", mean, None)]
    inner = algorithm  # a bare PowerGossip only: inside PeriodicAverage its steps are numbered differently
    if isinstance(inner, gossip.PowerGossip) and inner.matrices:
        peer = inner.schedule.peers(0, step).in_peers[0][0]  # the exchange of step index `step` is in flight
        edge = inner.edges[(0, peer)]
        right = edge.iteration % 2 == 1
        differences.append(("next_edge", replicas[peer], (inner, edge, right)))
    for kind, other, powergossip in differences:
        captured, total, stable, pg_energy = [0.0] * len(SPECTRUM_RANKS), 0.0, [], 0.0
        for name, x0 in replicas[0].items():
            difference = (x0 - other[name]).double()
            shares, stable_rank = capture_shares(difference)
            energy = float(difference.square().sum())
            total += energy
            captured = [c + s * energy for c, s in zip(captured, shares, strict=True)]
            stable.append(stable_rank)
        if powergossip is not None:
            inner, edge, right = powergossip
            total = 0.0  # over the compressed matrices only, as the factors cover them
            captured = [0.0] * len(SPECTRUM_RANKS)
            for i, matrix in enumerate(inner.matrices):
                difference = (replicas[0][matrix.entry.name] - other[matrix.entry.name]).double()
                difference = difference.reshape(matrix.m, matrix.k)
                factor = (edge.q if right else edge.p)[i].double().cpu()
                projected = difference @ factor if right else difference.T @ factor
                pg_energy += float(projected.square().sum())
                energy = float(difference.square().sum())
                shares, _ = capture_shares(difference)
                captured = [c + s * energy for c, s in zip(captured, shares, strict=True)]
                total += energy
        row = {"config": name, "seed": seed, "step": step, "kind": kind, "norm": math.sqrt(total)}
        for r, c in zip(SPECTRUM_RANKS, captured, strict=True):
            row[f"share_r{r}"] = c / total if total else 1.0
        row["stable_rank_mean"] = sum(stable) / len(stable)
        row["max_rank"] = max(min(x.shape) for x in replicas[0].values())
        row["pg_captured"] = pg_energy / total if powergossip is not None and total else math.nan
        rows.append(row)
    return rows
