r"""Finite-time exact schedules: Base-(k+1) graphs average exactly after one period for any n, k peers a step.

Takezawa, Sato, Bao, Niwa & Yamada, "Beyond Exponential Graph: Communication-Efficient Topologies for Decentralized
Learning via Finite-time Convergence", NeurIPS 2023 (arXiv 2305.11420), Sections 4 and 5. Every W(t) is symmetric
and doubly stochastic, every rank has at most ``max_degree`` = k peers in a step, and one period multiplies to
:math:`J = \frac1n \mathbf 1 \mathbf 1^\top`: from the period's first step, ``period`` steps of
:math:`x \leftarrow W(t)\,x` leave every rank with the exact mean. With n = 2^K and k = 1 it is the one-peer hypercube.

The construction, in three pieces (this module's own derivation of the paper's Algorithms 1 and 2):

1. **Hyper-hypercube** over m ranks whose prime factors are all at most k + 1: write :math:`m = f_1 f_2 \cdots f_R`
   with every :math:`f_r \le k + 1` and number the ranks in mixed radix :math:`(f_1, \ldots, f_R)`. At round r the
   ranks that differ only in digit r form a clique of :math:`f_r` ranks averaging with weights :math:`1/f_r`
   (:math:`f_r - 1 \le k` peers). After all R rounds every rank holds the mean, from any order of the rounds.
2. **Simple Base-(k+1) graph** over any n. Write n in base k + 1,
   :math:`n = \sum_{l=1}^{L} a_l (k+1)^{p_l}` with :math:`p_1 > \cdots > p_L` and :math:`1 \le a_l \le k`, and split
   the ranks into consecutive groups :math:`V_l` of :math:`a_l (k+1)^{p_l}` ranks, each a hyper-hypercube of
   :math:`h_l` rounds; :math:`R_l = V_{l+1} \cup \cdots \cup V_L` is what follows group l, with
   :math:`|R_l| < (k+1)^{p_l}`.

   * rounds :math:`0 \ldots h_1 - 1`: every group averages inside itself (its hyper-hypercube);
   * round :math:`h_1 + l - 1`, for :math:`l = 1 \ldots L-1`, **absorbs** :math:`V_l` into :math:`R_l`: every rank
     r of :math:`R_l` is joined to one rank of each of the :math:`a_l` blocks of :math:`(k+1)^{p_l}` ranks of
     :math:`V_l` (distinct ranks for distinct r) with weight :math:`b_l = |V_l| / (a_l S_l)`,
     :math:`S_l = |V_l| + |R_l|`; r keeps :math:`1 - a_l b_l`, a joined rank of :math:`V_l` keeps :math:`1 - b_l`;
   * rounds :math:`h_1 + l \ldots h_1 + l + h_l - 1`: :math:`V_l` averages inside itself again.

   Why it is exact. Before its absorb round :math:`V_l` holds one value :math:`\mu_l` on every rank, and every
   later group :math:`V_m` one value on each of its ranks (the absorb rounds of earlier groups give every rank of
   :math:`V_m` the same update). The round gives each r of :math:`R_l` the value
   :math:`(1 - |V_l|/S_l)\,x_r + (|V_l|/S_l)\,\mu_l`, so the mean of :math:`R_l` becomes the mean of
   :math:`V_l \cup R_l`; the sum being preserved, so does the mean of :math:`V_l`. The two parts then average
   independently: :math:`V_l` by its hyper-hypercube, :math:`R_l` by the next absorb rounds, and the last group
   :math:`V_L` holds one value, the mean. Inductively, after the period every rank holds the mean of all.
   Period: :math:`h_1` alone when L = 1, else :math:`\max_{l<L}(h_1 + l + h_l) = 2 h_1 + 1`.
3. **Base-(k+1) graph**: when every prime factor of n is at most k + 1, the shorter of the hyper-hypercube over n and
   the simple graph. Otherwise, with :math:`n = c\,m` where c is the largest divisor of n whose prime factors are
   at most k + 1, the c consecutive blocks of m ranks each run the simple graph over m at once, then the m lanes
   (the ranks at one position of every block) run a hyper-hypercube over c; whichever of this and the simple graph
   over n has the shorter period is the schedule (the paper's choice between its two algorithms).
"""

from __future__ import annotations

import numpy as np

from topologies.arguments import integer
from topologies.peer_view import Triplets
from topologies.schedule import Schedule, ScheduleError

#: One round's weights: the symmetric off-diagonal entries (i < j); the diagonal is 1 minus each row's sum.
Round = dict[tuple[int, int], float]


def _factors(m: int, k: int) -> list[int]:
    """m as a product of factors at most k + 1, largest first (greedy), or ScheduleError when impossible."""
    factors, rest = [], m
    for factor in range(k + 1, 1, -1):
        while rest % factor == 0:
            factors.append(factor)
            rest //= factor
    if rest != 1:
        raise ScheduleError(f"{m} ranks have a prime factor above max_degree + 1 = {k + 1}")
    return factors


def _smooth_part(n: int, k: int) -> int:
    """The largest divisor of n whose prime factors are all at most k + 1."""
    part, rest = 1, n
    for prime in range(2, k + 2):
        while rest % prime == 0:
            part, rest = part * prime, rest // prime
    return part


def _hyper_hypercube(members: list[int], k: int) -> list[Round]:
    """Part 1 of the module docstring: the rounds of cliques that average ``members`` exactly."""
    rounds, stride = [], 1
    for factor in _factors(len(members), k):
        weights: Round = {}
        for position in range(len(members)):
            if (position // stride) % factor:
                continue  # not the clique's lowest digit
            clique = [members[position + d * stride] for d in range(factor)]
            for a in range(factor):
                for b in range(a + 1, factor):
                    weights[(clique[a], clique[b])] = 1.0 / factor
        rounds.append(weights)
        stride *= factor
    return rounds


def _base_digits(n: int, k: int) -> list[tuple[int, int]]:
    """n in base k + 1 as (a_l, p_l) pairs with a_l >= 1, highest power first."""
    digits, power = [], 0
    while n:
        n, digit = divmod(n, k + 1)
        if digit:
            digits.append((digit, power))
        power += 1
    return digits[::-1]


def _simple_base_graph(members: list[int], k: int) -> list[Round]:
    """Part 2 of the module docstring over ``members`` (any number of them)."""
    groups, start = [], 0
    for digit, power in _base_digits(len(members), k):
        size = digit * (k + 1) ** power
        groups.append((members[start : start + size], digit, (k + 1) ** power))
        start += size
    inner = [_hyper_hypercube(group, k) for group, _, _ in groups]
    first, last = len(inner[0]), len(groups) - 1
    period = max([first] + [first + index + 1 + len(inner[index]) for index in range(last)])
    rounds: list[Round] = [{} for _ in range(period)]
    for own in inner:  # every group inside itself
        for r, weights in enumerate(own):
            rounds[r].update(weights)
    for index, (group, digit, block) in enumerate(groups[:last]):
        rest = [rank for later, _, _ in groups[index + 1 :] for rank in later]
        weight = len(group) / (digit * (len(group) + len(rest)))
        absorb = rounds[first + index]
        for position, rank in enumerate(rest):
            for b in range(digit):
                absorb[tuple(sorted((rank, group[b * block + position])))] = weight
        for r, weights in enumerate(inner[index]):  # the group inside itself again
            rounds[first + index + 1 + r].update(weights)
    return rounds


def _on_blocks(rounds: list[Round], blocks: list[list[int]]) -> list[Round]:
    """``rounds`` over ranks 0..m-1 run at once on every block (rank i of the rounds is ``block[i]``)."""
    return [{(block[i], block[j]): w for block in blocks for (i, j), w in weights.items()} for weights in rounds]


def base_graph_rounds(n: int, max_degree: int = 1) -> list[Round]:
    """The rounds of :func:`base_graph`, as symmetric off-diagonal weights (part 3 of the module docstring).

    Args:
        n: the number of ranks, >= 1.
        max_degree: k, the most peers a rank has in one round, >= 1.

    Returns:
        One dict per round, {(i, j): weight} with i < j; an empty list for n = 1.
    """
    simple = _simple_base_graph(list(range(n)), max_degree)
    smooth = _smooth_part(n, max_degree)
    if smooth == n:
        return min(simple, _hyper_hypercube(list(range(n)), max_degree), key=len)
    if smooth == 1:
        return simple
    m = n // smooth
    blocks = [list(range(g * m, (g + 1) * m)) for g in range(smooth)]
    lanes = [list(range(j, n, m)) for j in range(m)]
    within = _on_blocks(_simple_base_graph(list(range(m)), max_degree), blocks)
    across = _on_blocks(_hyper_hypercube(list(range(smooth)), max_degree), lanes)
    return min(simple, within + across, key=len)


def _triplets(n: int, weights: Round) -> Triplets:
    """The round's W(t): its symmetric off-diagonal entries and a diagonal that makes each row sum to 1."""
    pairs = np.array(list(weights), dtype=np.int64).reshape(-1, 2)
    values = np.array(list(weights.values()), dtype=np.float64)
    diagonal = np.ones(n)
    np.subtract.at(diagonal, pairs[:, 0], values)
    np.subtract.at(diagonal, pairs[:, 1], values)
    ranks = np.arange(n)
    return (
        np.concatenate([ranks, pairs[:, 0], pairs[:, 1]]),
        np.concatenate([ranks, pairs[:, 1], pairs[:, 0]]),
        np.concatenate([diagonal, values, values]),
    )


def base_graph(n: int, max_degree: int = 1) -> Schedule:
    """The Base-(k+1) graph over n ranks (module docstring): exact average after one period, from its first step.

    With ``max_degree=1`` each rank has at most one peer per step, like the one-peer hypercube, which it equals
    when n is a power of two; for other n the period is about twice log2 n (n = 6: 4 steps, n = 12: 5, n = 24: 6).

    >>> base_graph(6).period
    4

    Args:
        n: the number of ranks, >= 1 (n = 1 has the single step W = [1]).
        max_degree: k, the most peers of a rank in one step, >= 1.

    Returns:
        The validated schedule: symmetric, doubly stochastic; the product of its W(t) over one period, from step 0,
            is exactly J.

    Raises:
        ScheduleError: ``n`` or ``max_degree`` is not an integer >= 1.
    """
    n, k = integer("n", n, 1), integer("max_degree", max_degree, 1)
    rounds = [_triplets(n, weights) for weights in base_graph_rounds(n, k)] or [_triplets(n, {})]
    return Schedule(
        n,
        "base_graph",
        rounds.__getitem__,
        len(rounds),
        params={"n": n, "max_degree": k},
        symmetric=True,
        doubly_stochastic=True,
    )


__all__ = ["base_graph", "base_graph_rounds"]
