"""The torch.distributed exchange checks shapes once per peer, then trusts them, and still names a mismatch (Gloo)."""

from __future__ import annotations

import pytest
from helpers.launch import launch

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("protocol_worker.py", tmp_path_factory.mktemp("protocol"), [], backend="gloo", n=4)[0]


def test_headers_are_checked_at_the_first_exchange_and_when_both_ends_change_only(results):
    for rank, result in enumerate(results):
        assert result["handshakes"] == [[rank ^ 1], [rank ^ 1]], result["handshakes"]  # exchanges 0 and 5 of 7
        assert result["correct"]


def test_a_tensor_changed_on_one_end_only_is_named_on_both_ends(results):
    """Each end names the mismatch, except that one end may first see the other close its connection (the end
    that raised first exits with unread data, so TCP resets the connection): that end then names its peer."""
    mismatch = {
        0: "ExchangeMismatchError: rank 0: exchange 7: message from peer 1: peer 1 sends and expects what it did "
        "before, while rank 0 changed what it sends to or expects from it",
        1: "ExchangeMismatchError: rank 1: exchange 7: message from peer 0: peer 0 changed what it sends or expects",
    }
    named = [rank for rank in (0, 1) if results[rank]["error"].startswith(mismatch[rank])]
    assert named, [results[rank]["error"] for rank in (0, 1)]
    for rank in {0, 1} - set(named):
        assert results[rank]["error"].startswith(
            f"PeerFailedError: rank {rank}: exchange 7 with peer(s) [{1 - rank}]: peer {1 - rank} failed or closed"
        ), results[rank]["error"]


def test_a_peer_a_step_ahead_is_named_without_a_header_round_trip(results):
    assert results[2]["error"] == (
        "ExchangeMismatchError: rank 2: exchange 7: message from peer 3 belongs to exchange 8: the two ranks are at "
        "different steps or their schedules disagree"
    )
    assert "rank 3: exchange 8: message from peer 2 belongs to exchange 7" in results[3]["error"]
