"""Built-in schedules by name, for the CLIs: ``by_name("one_peer_hypercube", 16)``, ``names()``.

Every entry builds a schedule for n ranks from keyword options with sensible defaults:
torus picks the most square rows x cols with both >= 2 (a side of 2 has one neighbour in that dimension,
so 2 x 2 is the 4-ring and 2 x 4 has degree 3); random_regular uses degree 4 (n - 1 when n <= 4);
erdos_renyi uses p = min(1, 2 ln(n) / n) (twice the connectivity threshold); hierarchical and
alternating_exp_ring use per_node = 4 when n / 4 is a power of two >= 2, else 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from topologies import finite_time, static, time_varying
from topologies.arguments import integer
from topologies.schedule import Schedule, ScheduleError


@dataclass(frozen=True)
class _Entry:
    build: Callable[..., Schedule]
    options: tuple[str, ...]
    summary: str


def _torus(n: int, rows: int | None = None, weights: str = "uniform") -> Schedule:
    n = integer("n", n, 1)
    if rows is None:
        candidates = [r for r in range(2, math.isqrt(n) + 1) if n % r == 0]
        if not candidates:
            raise ScheduleError(f"torus needs n = rows * cols with rows, cols >= 2; n={n} has no such split")
        rows = candidates[-1]
    rows = integer("rows", rows, 1)
    if n % rows:
        raise ScheduleError(f"torus rows={rows} does not divide n={n}")
    return static.torus(rows, n // rows, weights)


def _random_regular(n: int, degree: int | None = None, seed: int = 0, weights: str = "uniform") -> Schedule:
    n = integer("n", n, 1)
    if degree is None:
        degree = 4 if n > 4 else n - 1
    return static.random_regular(n, degree, seed, weights)


def _erdos_renyi(n: int, p: float | None = None, seed: int = 0, weights: str = "metropolis") -> Schedule:
    n = integer("n", n, 1)
    return static.erdos_renyi(n, min(1.0, 2 * math.log(n) / n) if p is None else p, seed, weights)


def default_per_node(n: int) -> int:
    """The ``per_node`` that hierarchical schedules get by default: 4 when n / 4 is a power of two >= 2, else 2.

    Args:
        n: the number of ranks.

    Returns:
        4 or 2.
    """
    nodes = n // 4
    return 4 if n % 4 == 0 and nodes >= 2 and nodes & (nodes - 1) == 0 else 2


def _split(n: int, per_node: int | None, name: str) -> tuple[int, int]:
    n = integer("n", n, 1)
    per_node = default_per_node(n) if per_node is None else integer("per_node", per_node)
    if per_node < 1 or n % per_node:
        raise ScheduleError(f"{name}: per_node={per_node!r} does not divide n={n} (rank = node * per_node + local)")
    return n // per_node, per_node


def _by_nodes(build: Callable[[int, int], Schedule], name: str, n: int, per_node: int | None) -> Schedule:
    nodes, per_node = _split(n, per_node, name)
    try:
        return build(nodes, per_node)
    except ScheduleError as err:
        raise ScheduleError(
            f"{err} (n={n} split as nodes={nodes} x per_node={per_node}; try another per_node)"
        ) from err


def _alternating_exp_ring(n: int, per_node: int | None = None) -> Schedule:
    return _by_nodes(time_varying.alternating_exp_ring, "alternating_exp_ring", n, per_node)


def _hierarchical(n: int, per_node: int | None = None) -> Schedule:
    return _by_nodes(time_varying.hierarchical, "hierarchical", n, per_node)


_REGISTRY: dict[str, _Entry] = {
    "ring": _Entry(static.ring, ("weights",), "static cycle, uniform 1/3"),
    "torus": _Entry(_torus, ("rows", "weights"), "static 2-D periodic grid"),
    "complete": _Entry(static.complete, (), "static all-to-all, W = J"),
    "star": _Entry(static.star, ("weights",), "static star around rank 0, Metropolis"),
    "static_exponential": _Entry(static.static_exponential, (), "Ying et al. static exp graph"),
    "hypercube": _Entry(static.hypercube, ("weights",), "static hypercube, n = 2^K"),
    "random_regular": _Entry(_random_regular, ("degree", "seed", "weights"), "seeded random regular graph"),
    "erdos_renyi": _Entry(_erdos_renyi, ("p", "seed", "weights"), "seeded G(n, p), Metropolis"),
    "one_peer_ring": _Entry(time_varying.one_peer_ring, (), "Decent-DP one-peer ring, n even"),
    "one_peer_exponential": _Entry(time_varying.one_peer_exponential, (), "directed one-peer exp, n = 2^K"),
    "one_peer_hypercube": _Entry(time_varying.one_peer_hypercube, (), "i <-> i XOR 2^(t mod log2 n)"),
    "random_matchings": _Entry(time_varying.random_matchings, ("seed",), "seeded random perfect matchings"),
    "base_graph": _Entry(finite_time.base_graph, ("max_degree",), "Base-(k+1) graph: exact after a period, any n"),
    "alternating_exp_ring": _Entry(_alternating_exp_ring, ("per_node",), "Decent-DP AER over nodes"),
    "hierarchical": _Entry(_hierarchical, ("per_node",), "exact intra-node x one-peer inter-node"),
}


def names() -> list[str]:
    """The names of the built-in schedules, in registry order.

    Returns:
        Every name :func:`by_name` accepts.
    """
    return list(_REGISTRY)


def summary(name: str) -> str:
    """The one-line description of a built-in schedule.

    Args:
        name: one of :func:`names`.

    Returns:
        The description, for CLI listings.

    Raises:
        ScheduleError: ``name`` is not a built-in schedule.
    """
    return _entry(name).summary


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def by_name(name: str, n: int, **options: object) -> Schedule:
    """Build the built-in schedule ``name`` for n ranks; options not given (or None) take the registry's defaults.

    The defaults are listed in the docstring of :mod:`topologies.registry`.

    n and the integer options may be of any integer type (see :mod:`topologies.arguments`).

    Args:
        name: one of :func:`names`.
        n: the number of ranks, >= 1.
        **options: the schedule's own options (``weights``, ``rows``, ``degree``, ``p``, ``seed``, ``per_node``,
            as the schedule accepts them); None means the default.

    Returns:
        The validated schedule.

    Raises:
        ScheduleError: ``name`` is unknown, an option is not one the schedule takes, or the schedule cannot be
            built for these arguments (the message names the constraint).
    """
    entry = _entry(name)
    n = integer("n", n, 1)
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(entry.options))
    if unknown:
        raise ScheduleError(f"schedule {name!r} takes no option(s) {unknown}; it accepts {list(entry.options)}")
    return entry.build(n, **options)
