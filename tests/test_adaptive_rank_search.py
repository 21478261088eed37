"""GraVAC's ladder search (docs/design.md C.2, C.4) on given (gain, throughput) measurements."""

from __future__ import annotations

import pytest

from gossip.algorithms.adaptive_rank import LadderSearch


def walk(search: LadderSearch, measurements: dict[int, tuple[float, float]]) -> list[int]:
    """Feed the measurement of whichever rung is current until the search stops; return the ranks visited."""
    visited = [search.rank]
    while search.searching:
        visited.append(search.record(*measurements[search.rank]))
    return visited


def test_search_starts_at_the_bottom_rung():
    assert LadderSearch((1, 2, 4, 8)).rank == 1


def test_top_two_within_omega_keep_the_smaller_rank():
    visited = walk(LadderSearch((1, 2, 4, 8)), {1: (0.5, 1.0), 2: (0.9, 1.0), 4: (0.92, 1.0)})
    assert visited == [1, 2, 4, 2]  # CT 0.92 vs 0.90: within 5 %, keep rank 2


def test_falling_compression_throughput_stops_at_the_previous_rung():
    visited = walk(LadderSearch((1, 2, 4, 8)), {1: (0.8, 1.0), 2: (0.95, 0.5)})
    assert visited == [1, 2, 1]


def test_top_of_ladder_keeps_the_best_feasible_rank():
    measurements = {1: (0.3, 1.0), 2: (0.5, 1.0), 4: (0.8, 1.0), 8: (0.99, 0.9)}  # CT 0.8 -> 0.891: +11 %
    assert walk(LadderSearch((1, 2, 4, 8)), measurements)[-1] == 8


def test_no_feasible_rank_falls_back_to_the_highest_gain():
    measurements = {1: (0.1, 1.0), 2: (0.2, 1.0), 4: (0.4, 1.0)}
    assert walk(LadderSearch((1, 2, 4), epsilon=0.75), measurements)[-1] == 4


def test_reopen_restarts_from_the_bottom_and_forgets():
    search = LadderSearch((1, 2, 4))
    walk(search, {1: (0.9, 1.0), 2: (0.91, 1.0)})
    search.reopen()
    assert (search.rank, search.searching, search.measured) == (1, True, {})


@pytest.mark.parametrize("ladder", [(), (2, 1), (1, 1, 2), (0, 1), (1.5,)])
def test_bad_ladder_is_refused(ladder):
    with pytest.raises(ValueError, match="ladder"):
        LadderSearch(ladder)
