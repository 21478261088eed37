"""Integers of any kind (int, numpy integers, anything ``operator.index`` accepts) are sizes; bool and float are not.

Issue 31: ``ring(np.int64(8))`` was refused. The schedule built from a numpy integer must be the very schedule
built from the Python int (same fingerprint, Python ints in its parameters).
"""

import numpy as np
import pytest

import topologies
from topologies import ScheduleError
from topologies.report import compare


class _Index:
    """Not an int, but an integer by ``operator.index``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


KINDS = [np.int64, np.int32, np.uint16, _Index]

CONSTRUCTORS = {
    "ring": (topologies.ring, (8,)),
    "torus": (topologies.torus, (3, 4)),
    "complete": (topologies.complete, (5,)),
    "star": (topologies.star, (6,)),
    "static_exponential": (topologies.static_exponential, (6,)),
    "hypercube": (topologies.hypercube, (8,)),
    "random_regular": (topologies.random_regular, (10, 3, 4)),
    "erdos_renyi": (lambda n, seed: topologies.erdos_renyi(n, 0.6, seed), (10, 2)),
    "one_peer_ring": (topologies.one_peer_ring, (8,)),
    "one_peer_exponential": (topologies.one_peer_exponential, (8,)),
    "one_peer_hypercube": (topologies.one_peer_hypercube, (8,)),
    "random_matchings": (topologies.random_matchings, (9, 3)),
    "alternating_exp_ring": (topologies.alternating_exp_ring, (4, 2)),
    "hierarchical": (topologies.hierarchical, (4, 3)),
}


def _is_plain_int_params(schedule: topologies.Schedule) -> bool:
    return type(schedule.n) is int and all(type(v) in (int, float, str) for v in schedule.params.values())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("name", list(CONSTRUCTORS))
def test_every_constructor_takes_any_integer_kind(name, kind):
    build, args = CONSTRUCTORS[name]
    schedule = build(*(kind(a) for a in args))
    assert schedule.fingerprint() == build(*args).fingerprint()
    assert _is_plain_int_params(schedule)
    assert repr(schedule) == repr(build(*args))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("name", topologies.names())
def test_by_name_takes_any_integer_kind_for_n(name, kind):
    schedule = topologies.by_name(name, kind(16))
    assert schedule.fingerprint() == topologies.by_name(name, 16).fingerprint()
    assert _is_plain_int_params(schedule)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("torus", {"rows": np.int64(2)}),
        ("random_regular", {"degree": np.int64(3), "seed": np.int64(1)}),
        ("erdos_renyi", {"seed": np.int64(1)}),
        ("random_matchings", {"seed": np.int64(1)}),
        ("hierarchical", {"per_node": np.int64(2)}),
        ("alternating_exp_ring", {"per_node": np.int64(2)}),
    ],
)
def test_by_name_takes_numpy_integer_options(name, options):
    plain = {k: int(v) for k, v in options.items()}
    assert topologies.by_name(name, 16, **options).fingerprint() == topologies.by_name(name, 16, **plain).fingerprint()


def test_from_edge_list_takes_a_numpy_integer_n(tmp_path):
    path = tmp_path / "edges.txt"
    path.write_text("0 1\n1 2\n2 0\n")
    assert topologies.from_edge_list(path, n=np.int64(3)).fingerprint() == topologies.from_edge_list(path).fingerprint()


def test_compare_takes_a_numpy_integer():
    built, _ = compare(np.int64(4))
    assert {s.n for s in built} == {4} and all(type(s.n) is int for s in built)


@pytest.mark.parametrize("value", [True, np.True_, 8.0, "8", None], ids=repr)
@pytest.mark.parametrize("name", list(CONSTRUCTORS))
def test_bool_float_and_str_are_refused_as_sizes_naming_the_argument(name, value):
    build, args = CONSTRUCTORS[name]
    with pytest.raises(ScheduleError, match=r"must be an integer"):
        build(value, *args[1:])


@pytest.mark.parametrize("value", [True, 8.0])
def test_by_name_refuses_bool_and_float_n(value):
    with pytest.raises(ScheduleError, match=r"n must be an integer"):
        topologies.by_name("ring", value)


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: topologies.torus(3, True), "cols"),
        (lambda: topologies.random_regular(8, True), "degree"),
        (lambda: topologies.random_matchings(8, seed=True), "seed"),
        (lambda: topologies.hierarchical(2, True), "per_node"),
        (lambda: topologies.alternating_exp_ring(2, True), "per_node"),
        (lambda: topologies.by_name("hierarchical", 8, per_node=True), "per_node"),
        (lambda: topologies.by_name("torus", 8, rows=2.0), "rows"),
        (lambda: topologies.Schedule(True, "one", lambda t: ([0], [0], [1.0]), 1), "n"),
    ],
)
def test_bool_and_float_options_are_refused_naming_the_option(build, argument):
    with pytest.raises(ScheduleError, match=rf"\b{argument}\b.*must be an integer|\b{argument} must be an integer"):
        build()
