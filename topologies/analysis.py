"""Spectral analysis, consensus simulation and communication volume (docs/design.md F.3, F.4, A.9).

Notation: J = (1/n) 1 1^T. For a step W(t), rho = ||W - J||_2 and the spectral gap is 1 - |lambda_2(W)|, the
two related by 1 - |lambda_2(W)| >= 1 - rho with equality for symmetric W (F.3; see :func:`spectral_gap`).
For a periodic schedule the product over one period is Pi = W(p-1) ... W(0). Consensus distance (F.4,
Kong et al. 2021): Xi_t^2 = (1/n) sum_i ||x_i^t - xbar^t||^2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from topologies.schedule import Schedule, ScheduleError

ALGORITHMS = ("exact", "powergossip", "allreduce")


def rho(matrix: np.ndarray) -> float:
    """rho = ||W - J||_2, the largest singular value of W - J (docs/design.md F.3).

    The worst-case factor by which one step shrinks the distance to the average, ||(W - J) x|| <= rho ||x - xbar||,
    for a doubly stochastic W (directed ones included). For a W that is row- but not column-stochastic it can
    exceed 1 (uniform star of 8 ranks: 1.06) although the steps still converge: see :func:`spectral_gap`.

    Args:
        matrix: a mixing matrix W of shape (n, n), e.g. a schedule's ``mixing_matrix(t)`` or a period product.

    Returns:
        rho >= 0, which is 0 exactly when W = J.
    """
    n = matrix.shape[0]
    return float(np.linalg.norm(matrix - np.full((n, n), 1.0 / n), 2))


def spectral_gap(matrix: np.ndarray) -> float:
    """The spectral gap delta = 1 - |lambda_2(W)| of a row-stochastic W (docs/design.md F.3).

    |lambda_1| = 1 >= |lambda_2| >= ... are the eigenvalue moduli of W (Koloskova, Stich, Jaggi, "Decentralized
    Stochastic Optimization and Gossip Algorithms with Compressed Communication", ICML 2019).

    Defined for every row-stochastic W, symmetric or not, and always in [0, 1] (a stochastic matrix has spectral
    radius 1). It is computed as 1 - r(W - J), r the spectral radius: by Brauer's theorem, W 1 = 1 makes the
    eigenvalues of W - 1 (1^T / n) those of W with lambda_1 = 1 replaced by 0, so r(W - J) = |lambda_2(W)|.
    Since r(A) <= ||A||_2, delta >= 1 - rho, with equality when W - J is normal: every symmetric W, and circulant
    ones such as the exponential graphs. delta is the asymptotic rate: W^t -> 1 pi^T (pi the left Perron vector,
    1/n when W is doubly stochastic) as |lambda_2|^t up to a polynomial factor; 0 for a step that leaves the ranks
    in several groups (one-peer steps), 1 for W = J.

    Args:
        matrix: a square row-stochastic W, e.g. a schedule's ``mixing_matrix(t)``.

    Returns:
        delta in [0, 1].

    Raises:
        ScheduleError: ``matrix`` is not square, or one of its rows does not sum to 1 (within 1e-9).
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    n = matrix.shape[0]
    if matrix.ndim != 2 or matrix.shape != (n, n) or not np.allclose(matrix.sum(axis=1), 1.0, rtol=0, atol=1e-9):
        raise ScheduleError(
            "spectral_gap needs a square row-stochastic W (property 'row-stochastic': every row sums to 1); "
            "pass a schedule's mixing_matrix(t)"
        )
    deviation = matrix - np.full((n, n), 1.0 / n)
    if np.allclose(matrix, matrix.T, rtol=0, atol=1e-12):
        eigenvalues = np.linalg.eigvalsh((deviation + deviation.T) / 2)
    else:
        eigenvalues = np.linalg.eigvals(deviation)
    return float(np.clip(1.0 - np.abs(eigenvalues).max(), 0.0, 1.0))  # [0, 1] exactly; clip the rounding


def step_rhos(schedule: Schedule) -> np.ndarray:
    """rho(W(t)) = ||W(t) - J||_2 for every step t of ``schedule.check_steps`` (see :func:`rho`).

    Args:
        schedule: the schedule to analyse.

    Returns:
        One value per step of one period (of the first ``window`` steps when aperiodic), in step order.
    """
    return np.array([rho(schedule.mixing_matrix(t)) for t in schedule.check_steps])


def step_gaps(schedule: Schedule) -> np.ndarray:
    """spectral_gap(W(t)) = 1 - |lambda_2(W(t))| for every step t of ``schedule.check_steps``.

    Args:
        schedule: the schedule to analyse.

    Returns:
        One gap in [0, 1] per step of one period (of the first ``window`` steps when aperiodic), in step order.

    Raises:
        ScheduleError: a step is not row-stochastic (possible only for a schedule built with ``validate=False``).
    """
    return np.array([spectral_gap(schedule.mixing_matrix(t)) for t in schedule.check_steps])


def period_product(schedule: Schedule) -> np.ndarray:
    """The product Pi = W(p-1) ... W(0) over one period (over the first ``window`` steps when aperiodic).

    Args:
        schedule: the schedule to multiply out.

    Returns:
        Pi, a dense float64 array of shape (n, n).
    """
    product = np.eye(schedule.n)
    for t in schedule.check_steps:
        product = apply_step(schedule, t, product)
    return product


def period_rho(schedule: Schedule) -> float:
    """||Pi - J||_2 for the product Pi over one period (see :func:`period_product`).

    It is 0 for the schedules that reach the exact average in finite time (the one-peer ones at n = 2^K).

    Args:
        schedule: the schedule to analyse.

    Returns:
        ||Pi - J||_2 >= 0.
    """
    return rho(period_product(schedule))


def optimal_overrelaxation(schedule_or_matrix: Schedule | np.ndarray) -> float:
    """The optimal over-relaxation gamma* = 2 / (mu_min + mu_max) over the non-zero eigenvalues mu of I - W.

    Mixing with x <- x + gamma (W - I) x contracts fastest at gamma* (the classic optimal Richardson step).
    W must be symmetric, so that the mu are real.

    Args:
        schedule_or_matrix: a static schedule (period 1) or a symmetric mixing matrix W of shape (n, n).

    Returns:
        gamma*; 1.0 when I - W has no non-zero eigenvalue (W = I).

    Raises:
        ScheduleError: W is not symmetric, or the schedule is time-varying (period other than 1).
    """
    matrix = _static_matrix(schedule_or_matrix)
    if not np.allclose(matrix, matrix.T, atol=1e-12):
        raise ScheduleError("optimal_overrelaxation needs a symmetric W (property 'symmetric')")
    mu = 1.0 - np.linalg.eigvalsh(matrix)
    nonzero = mu[np.abs(mu) > 1e-10]
    if nonzero.size == 0:
        return 1.0
    return float(2.0 / (nonzero.min() + nonzero.max()))


def _static_matrix(schedule_or_matrix: Schedule | np.ndarray) -> np.ndarray:
    if isinstance(schedule_or_matrix, Schedule):
        if schedule_or_matrix.period != 1:
            raise ScheduleError(
                f"schedule '{schedule_or_matrix.name}' is time-varying (period={schedule_or_matrix.period}); "
                "pass one step's mixing_matrix(t)"
            )
        return schedule_or_matrix.mixing_matrix(0)
    return np.asarray(schedule_or_matrix, dtype=np.float64)


@dataclass(frozen=True)
class ConsensusRate:
    """Koloskova et al. 2020 consensus rate: E||Pi X - Xbar||^2 <= (1 - p) ||X - Xbar||^2 over tau steps.

    Attributes:
        p: the contraction of the squared consensus distance over tau steps, 1 - p being its worst-case factor.
        tau: the number of steps the contraction spans (the period, or 1 when aperiodic).
    """

    p: float
    tau: int


def expected_consensus_rate(schedule: Schedule) -> ConsensusRate:
    """The consensus rate p over tau steps of ``schedule`` (docs/design.md F.3).

    Periodic: tau = period, 1 - p = ||(I - J) Pi||_2^2 (worst case over X, so exact).
    Aperiodic: tau = 1 and 1 - p = lambda_max((I - J) mean_t[W(t)^T (I - J) W(t)] (I - J)), the
    expectation estimated by the mean over the first ``window`` steps.

    Args:
        schedule: the schedule to analyse.

    Returns:
        The rate as a :class:`ConsensusRate` (p, tau).
    """
    n = schedule.n
    centering = np.eye(n) - 1.0 / n
    if schedule.period is not None:
        contraction = np.linalg.norm(centering @ period_product(schedule), 2) ** 2
        return ConsensusRate(p=float(1.0 - contraction), tau=schedule.period)
    second_moment = np.zeros((n, n))
    for t in schedule.check_steps:
        w = schedule.mixing_matrix(t)
        second_moment += w.T @ centering @ w
    second_moment /= len(schedule.check_steps)
    largest = np.linalg.eigvalsh(centering @ second_moment @ centering).max()
    return ConsensusRate(p=float(1.0 - largest), tau=1)


def apply_step(schedule: Schedule, t: int, values: np.ndarray) -> np.ndarray:
    """W(t) @ values using the sparse step, without building the dense W.

    Args:
        schedule: the schedule whose step t is applied.
        t: the step, an integer >= 0.
        values: one row per rank (shape (n, ...)).

    Returns:
        W(t) @ values, float64, of the shape of ``values``.

    Raises:
        ScheduleError: ``t`` is negative or not an integer.
    """
    rows, cols, weights = schedule.triplets(t)
    out = np.zeros_like(values, dtype=np.float64)
    np.add.at(out, rows, weights.reshape(-1, *([1] * (values.ndim - 1))) * values[cols])
    return out


def consensus_distance(values: np.ndarray) -> float:
    """The consensus distance Xi^2 = (1/n) sum_i ||x_i - xbar||^2 (docs/design.md F.4).

    Args:
        values: one row x_i per rank (shape (n, ...)).

    Returns:
        Xi^2 >= 0.
    """
    return float(np.mean(np.sum((values - values.mean(axis=0)) ** 2, axis=tuple(range(1, values.ndim)))))


def simulate_consensus(schedule: Schedule, steps: int, *, dim: int = 16, seed: int = 0) -> np.ndarray:
    """The trajectory Xi_0^2 .. Xi_steps^2 of plain gossip x <- W(t) x from standard normal x_i in R^dim.

    Args:
        schedule: the schedule to gossip with.
        steps: the number of gossip steps, >= 0.
        dim: the dimension of each rank's x_i, >= 1.
        seed: the seed of the initial x (numpy ``default_rng``).

    Returns:
        The consensus distances Xi_t^2 for t = 0 .. steps, ``steps + 1`` values.

    Raises:
        ScheduleError: ``steps`` < 0 or ``dim`` < 1.
    """
    if steps < 0 or dim < 1:
        raise ScheduleError(f"simulate_consensus needs steps >= 0 and dim >= 1, got steps={steps}, dim={dim}")
    values = np.random.default_rng(seed).standard_normal((schedule.n, dim))
    trajectory = [consensus_distance(values)]
    for t in range(steps):
        values = apply_step(schedule, t, values)
        trajectory.append(consensus_distance(values))
    return np.array(trajectory)


def _conjugate(schedule: Schedule, t: int, covariance: np.ndarray) -> np.ndarray:
    """W(t) S W(t)^T for a symmetric S, by two sparse steps."""
    return apply_step(schedule, t, apply_step(schedule, t, covariance).T).T


def noise_floor(schedule: Schedule, *, max_doublings: int = 64) -> float:
    r"""The consensus distance gossip settles at when every step adds unit noise to every rank.

    The replicas follow :math:`X_{t+1} = W(t) X_t + \Xi_t`, :math:`\Xi_t` independent standard normal per rank and
    coordinate: plain gossip of a model whose ranks each add a fresh gradient step, the setting of the consensus
    distance's recursion in Koloskova et al. (ICML 2020, "A Unified Theory of Decentralized SGD with Changing
    Topology and Local Updates"). For a doubly stochastic W the disagreement :math:`D = (I - J) X` follows
    :math:`D_{t+1} = W(t) D_t + (I - J) \Xi_t`, so its covariance per coordinate obeys

    .. math::  S_{t+1} = W(t)\, S_t\, W(t)^T + (I - J).

    Over one period (the first ``window`` steps when aperiodic, as :func:`period_product`) that is
    :math:`S \mapsto \Phi S \Phi^T + Q`, whose fixed point :math:`S^* = \sum_k \Phi^k Q (\Phi^k)^T` is summed by
    doubling (:math:`S \leftarrow S + A S A^T`, :math:`A \leftarrow A^2`, from :math:`A = \Phi - J`). The floor is
    :math:`\operatorname{tr}(S_t) / n`, the steady :math:`\Xi_t^2` per coordinate, averaged over the period's steps
    from :math:`S^*`. Exact averaging at every step (W = J) gives (n - 1) / n, its least value; a schedule that
    leaves ranks idle, or mixes slowly, more: the replicas' spread that a per-step noise sustains.

    Args:
        schedule: the schedule.
        max_doublings: the most doublings (the sum covers :math:`2^{\text{max\_doublings}}` periods).

    Returns:
        The floor; ``inf`` when the period's product does not contract the disagreement within that sum (ranks
            that never meet), ``nan`` when a W(t) is not doubly stochastic (the mean itself drifts).
    """
    n = schedule.n
    if not schedule.is_doubly_stochastic:
        return math.nan
    if n == 1:
        return 0.0
    centering = np.eye(n) - 1.0 / n
    steady = np.zeros((n, n))
    for t in schedule.check_steps:  # Q: one period's noise from S = 0
        steady = _conjugate(schedule, t, steady) + centering
    contraction = period_product(schedule) - 1.0 / n
    for _ in range(max_doublings):
        steady = steady + contraction @ steady @ contraction.T
        contraction = contraction @ contraction
        if not np.isfinite(contraction).all() or np.abs(contraction).max() > 1e12:
            return math.inf
        if np.abs(contraction).max() < 1e-14:
            break
    else:
        return math.inf
    floors = []
    for t in schedule.check_steps:
        steady = _conjugate(schedule, t, steady) + centering
        floors.append(float(np.trace(steady)) / n)
    return float(np.mean(floors))


def steps_to_consensus(schedule: Schedule, tol: float = 1e-6, *, max_steps: int = 100_000) -> int | None:
    """The smallest t with ||(I - J) W(t-1) ... W(0)||_2^2 <= tol.

    That is the number of steps after which Xi_t^2 <= tol * Xi_0^2 for *every* initial x (worst case),
    so it is deterministic: log2 n for the one-peer hypercube and exponential graphs when n = 2^K.

    Args:
        schedule: the schedule to analyse.
        tol: the tolerance on the squared consensus distance, relative to the start, in (0, 1).
        max_steps: the last step checked.

    Returns:
        That t, or None when it is not reached within ``max_steps`` steps.

    Raises:
        ScheduleError: ``tol`` is not in (0, 1).
    """
    if not 0 < tol < 1:
        raise ScheduleError(f"steps_to_consensus needs 0 < tol < 1, got tol={tol}")
    n = schedule.n
    product = np.eye(n)
    for t in range(max_steps + 1):
        deviation = product - product.mean(axis=0)
        # ||A||_2^2 >= ||A||_F^2 / n: skip the SVD while the Frobenius norm proves we are not there yet.
        frobenius_sq = float(np.sum(deviation**2))
        if frobenius_sq <= n * tol and np.linalg.norm(deviation, 2) ** 2 <= tol:
            return t
        product = apply_step(schedule, t, product)
    return None


def exact_averaging_starts(schedule: Schedule, *, probes: int = 4, seed: int = 0) -> dict[int, int]:
    """Where a periodic schedule averages exactly in finite time: {phase p: s} with W(t+s-1) ... W(t) = J.

    For every phase p of the period, s is the fewest steps (at most one period) after which gossip started at any
    step t = p (mod period) leaves every rank with the exact mean, or p is absent when one period does not. Tested
    on ``probes`` random vectors (a product other than J moves a random vector off the mean with probability 1),
    to 1e-9 of their scale. The one-peer hypercube averages exactly from every phase (its steps commute), a
    Base-(k+1) graph (:func:`topologies.base_graph`) from its first.

    Args:
        schedule: the schedule; an aperiodic one has no such phases.
        probes: the number of random vectors, >= 1.
        seed: their seed (numpy ``default_rng``).

    Returns:
        The phases and their step counts; empty when there are none.
    """
    if schedule.period is None:
        return {}
    start = np.random.default_rng(seed).standard_normal((schedule.n, probes))
    starts = {}
    for phase in range(schedule.period):
        values = start
        for steps in range(1, schedule.period + 1):
            values = apply_step(schedule, phase + steps - 1, values)
            if np.abs(values - start.mean(axis=0)).max() <= 1e-9 * np.abs(start).max():
                starts[phase] = steps
                break
    return starts


def _message_elements(param_shapes: Iterable[Sequence[int]], algorithm: str, rank: int, iterations: int = 1) -> float:
    """Elements one rank sends to one peer in one step (per direction, per edge)."""
    full = compressed_odd = compressed_even = uncompressed = 0
    for shape in param_shapes:
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ScheduleError(f"parameter shape {shape} has a negative dimension")
        size = math.prod(shape)
        full += size
        if len(shape) < 2:
            uncompressed += size
        else:
            m, k = shape[0], size // shape[0] if shape[0] else 0
            r = min(m, k, rank)
            compressed_odd += r * m
            compressed_even += r * k
    if algorithm == "exact":
        return float(full)
    return iterations * (compressed_odd + compressed_even) / 2 + uncompressed


def bytes_per_step(
    schedule: Schedule,
    param_shapes: Iterable[Sequence[int]],
    algorithm: str = "exact",
    rank: int = 1,
    bytes_per_element: int = 4,
    rank_id: int | None = None,
    iterations: int = 1,
) -> float:
    """Bytes one rank sends per step, averaged over one period (and over ranks when ``rank_id`` is None).

    - ``exact``: every out-peer gets the full model, M = sum_l prod(shape_l) elements.
    - ``powergossip`` (A.9): per edge per direction and power iteration sum_l r m_l elements on odd and
      sum_l r k_l on even iterations, averaged, where each tensor is reshaped to (m_l, k_l) = (shape[0], -1)
      and r = min(m_l, k_l, rank), times ``iterations`` per step; tensors with ndim < 2 are sent uncompressed on
      top, once per step (PowerGossip's default: with the first iteration). Needs a symmetric schedule.
    - ``allreduce``: ring all-reduce, 2 (n - 1) / n * M per rank, independent of the schedule's edges.

    Args:
        schedule: who sends to whom; its out-degrees count the messages.
        param_shapes: the shape of every parameter tensor of the model.
        algorithm: ``"exact"``, ``"powergossip"`` or ``"allreduce"``.
        rank: PowerGossip's rank r, >= 1 (ignored by the others).
        bytes_per_element: the size of one element of a message, > 0 (4 for float32, 2 for float16).
        rank_id: the rank whose sends are counted; None averages over all ranks.
        iterations: PowerGossip's power iterations per step, >= 1.

    Returns:
        The bytes sent per step.

    Raises:
        ScheduleError: an unknown ``algorithm``, ``rank`` < 1, ``bytes_per_element`` <= 0, ``iterations`` < 1, a
            shape with a negative dimension, or ``powergossip`` on a schedule that is not symmetric.
    """
    if algorithm not in ALGORITHMS:
        raise ScheduleError(f"unknown algorithm={algorithm!r}; expected one of {ALGORITHMS}")
    if rank < 1 or bytes_per_element <= 0 or iterations < 1:
        raise ScheduleError(
            f"need rank >= 1, bytes_per_element > 0 and iterations >= 1, got rank={rank}, {bytes_per_element=}, "
            f"{iterations=}"
        )
    shapes = list(param_shapes)
    if algorithm == "allreduce":
        n = schedule.n
        return 2.0 * (n - 1) / n * _message_elements(shapes, "exact", rank) * bytes_per_element
    if algorithm == "powergossip" and not schedule.is_symmetric:
        raise ScheduleError(
            f"schedule '{schedule.name}' is not symmetric (property 'symmetric'); PowerGossip needs pairwise "
            "exchange: use e.g. one_peer_hypercube(n)"
        )
    ranks = range(schedule.n) if rank_id is None else [rank_id]
    steps = schedule.check_steps
    sends = sum(len(schedule.peers(r, t).out_peers) for r in ranks for t in steps)
    mean_out_degree = sends / (len(ranks) * len(steps))
    return mean_out_degree * _message_elements(shapes, algorithm, rank, iterations) * bytes_per_element
