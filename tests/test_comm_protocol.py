"""The torch.distributed exchange checks shapes once per peer, then trusts them, and still names a mismatch (Gloo)."""

from __future__ import annotations

import pytest
from helpers.launch import launch

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("protocol_worker.py", tmp_path_factory.mktemp("protocol"), [], backend="gloo", n=6)[0]


def test_headers_are_checked_at_the_first_exchange_and_where_the_layout_is_not_the_predicted_one(results):
    """Exchanges A A A B B A B A B: checked at 0, 3 (the change to B), 5, 6 and 7 (until A B has repeated once);
    the ninth exchange, B, is steady: the alternation repeats, and the tenth is predicted to carry A."""
    for rank, result in enumerate(results):
        assert result["handshakes"] == [[rank ^ 1]] * 5, result["handshakes"]
        assert result["correct"]


def test_a_tensor_changed_on_one_end_only_is_named_on_both_ends(results):
    """Each end names the mismatch, except that one end may first see the other close its connection (the end
    that raised first exits with unread data, so TCP resets the connection): that end then names its peer."""
    mismatch = {
        0: "ExchangeMismatchError: rank 0: exchange 9: message from peer 1: peer 1 sends and expects what it did "
        "before, while rank 0 changed what it sends to or expects from it",
        1: "ExchangeMismatchError: rank 1: exchange 9: message from peer 0: peer 0 changed what it sends or expects",
    }
    named = [rank for rank in (0, 1) if results[rank]["error"].startswith(mismatch[rank])]
    assert named, [results[rank]["error"] for rank in (0, 1)]
    for rank in {0, 1} - set(named):
        assert results[rank]["error"].startswith(
            f"PeerFailedError: rank {rank}: exchange 9 with peer(s) [{1 - rank}]: peer {1 - rank} failed or closed"
        ), results[rank]["error"]


def test_a_peer_a_step_ahead_is_named_without_a_header_round_trip(results):
    assert results[2]["error"] == (
        "ExchangeMismatchError: rank 2: exchange 9: message from peer 3 belongs to exchange 10: the two ranks are at "
        "different steps or their schedules disagree"
    )
    assert "rank 3: exchange 10: message from peer 2 belongs to exchange 9" in results[3]["error"]


def test_a_layout_checked_before_but_not_predicted_is_named_on_both_ends(results):
    """Rank 4 sends and expects B, a layout the pair checked before, where the alternation predicts A (which rank 5
    carries): rank 4 re-checks its tensors, and both ends name the disagreement, as for a new layout."""
    assert results[4]["error"].startswith(
        "ExchangeMismatchError: rank 4: exchange 9: message from peer 5: peer 5 sends and expects what it did "
        "before, while rank 4 changed what it sends to or expects from it"
    ) or results[4]["error"].startswith("PeerFailedError: rank 4: exchange 9 with peer(s) [5]"), results[4]["error"]
    assert results[5]["error"].startswith(
        "ExchangeMismatchError: rank 5: exchange 9: message from peer 4: peer 4 changed what it sends or expects"
    ) or results[5]["error"].startswith("PeerFailedError: rank 5: exchange 9 with peer(s) [4]"), results[5]["error"]
    assert any(results[rank]["error"].startswith("ExchangeMismatchError") for rank in (4, 5))
