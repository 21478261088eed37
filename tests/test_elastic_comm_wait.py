"""An elastic exchange's wait (``gossip.backends.elastic_comm``): a change interrupts it, except while completing.

A wait on a posted exchange raises :class:`MembershipChangedError` as soon as a change is under way, so that the
rank takes part in the decision instead of waiting for a peer that may be gone. Once the decision resolved the step
as *completed* (both ends posted it, both apply it), waiting on it again must not be interrupted by a further
change: the live partner applies the step, and this end dropping it would mix it on one end only.
"""

from __future__ import annotations

import concurrent.futures
import threading
import types

import pytest

from gossip.backends.elastic_comm import _Interruptible
from gossip.errors import MembershipChangedError


class PostedExchange:
    """A posted exchange's handle: its transfers end when ``future`` is done."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self.waited = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        self._future.result(timeout)
        self.waited = True


def comm_during_a_change(completing: bool) -> types.SimpleNamespace:
    membership = types.SimpleNamespace(changed=threading.Event())
    membership.changed.set()
    return types.SimpleNamespace(membership=membership, rank=1, completing=completing)


def test_a_change_interrupts_the_wait_on_a_posted_exchange():
    exchange = PostedExchange()
    with pytest.raises(MembershipChangedError, match="rank 1: a wait was interrupted: the membership is changing"):
        _Interruptible(exchange, comm_during_a_change(completing=False)).wait()
    assert not exchange.waited  # the transfers stay posted: waiting again after the decision completes them


def test_a_change_does_not_interrupt_completing_a_step_the_partner_applies():
    exchange = PostedExchange()
    handle = _Interruptible(exchange, comm_during_a_change(completing=True))
    arrived = threading.Timer(0.2, exchange._future.set_result, (None,))  # the partner's message arrives later
    arrived.start()
    handle.wait()
    assert exchange.waited and handle.wait_seconds > 0


def test_completing_still_ends_with_the_partners_failure():
    exchange = PostedExchange()
    exchange._future.set_exception(ConnectionResetError("peer 2 closed the connection"))
    with pytest.raises(ConnectionResetError):
        _Interruptible(exchange, comm_during_a_change(completing=True)).wait()
