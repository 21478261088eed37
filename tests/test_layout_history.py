"""The prediction that makes an exchange steady (:class:`gossip.backends.wire.LayoutHistory`): repeated and cyclic
layouts settle, and both ends of a pair, holding the same history, always predict each other's layout."""

from __future__ import annotations

import itertools

from gossip.backends.wire import LayoutHistory


def checked_at(layouts: list[str]) -> list[int]:
    """The exchanges at which the per-tensor headers travel for this sequence of layouts."""
    history, checked = LayoutHistory(), []
    for index, layout in enumerate(layouts):
        if history.predicted() != layout:
            checked.append(index)
        history.record(layout)
    return checked


def test_an_unchanged_layout_is_checked_once():
    assert checked_at(["a"] * 6) == [0]


def test_a_cycle_is_checked_during_its_first_round_only():
    assert checked_at(["L", "R"] * 5) == [0, 1, 2, 3]  # as PowerGossip's left and right products alternate
    # three power iterations per step with the uncompressed tensors in the first: a cycle of 6 over 4 layouts
    cycle = ["L+x", "R", "L", "R+x", "L", "R"]
    assert checked_at(cycle * 4) == list(range(12))


def test_a_change_of_pattern_is_checked_where_it_breaks_the_prediction():
    assert checked_at(["a", "a", "a", "b", "b", "a", "b", "a", "b"]) == [0, 3, 5, 6, 7]
    assert checked_at(["L", "R", "L", "R", "L", "L"]) == [0, 1, 2, 3, 5]  # a layout seen before, not predicted


def test_both_ends_go_steady_only_on_the_same_layout():
    """Whatever the shared history, an exchange is steady on both ends only if both carry the layout it predicts
    (so, mirrored, each other's): two ends on different layouts cannot both skip the check."""
    for history in itertools.product("ab", repeat=8):
        ends = LayoutHistory(), LayoutHistory()
        for layout in history:
            for end in ends:
                end.record(layout)
        predicted = ends[0].predicted()
        assert predicted == ends[1].predicted()
        steady = [layout for layout in "abc" if layout == predicted]
        assert len(steady) == 1
