"""An elastic exchange's wait (``gossip.backends.elastic_comm``): a change interrupts it, except while completing.

A wait on a posted exchange raises :class:`MembershipChangedError` as soon as a change is under way, so that the
rank takes part in the decision instead of waiting for a peer that may be gone. Once the decision resolved the step
as *completed* (both ends posted it, both apply it), waiting on it again must not be interrupted by a further
change: the live partner applies the step, and this end dropping it would mix it on one end only. An exchange
that the group's thread refused because an earlier operation failed is a change to resolve as well, not a misuse.
"""

from __future__ import annotations

import concurrent.futures
import threading
import types

import pytest

from gossip.backends.comm_thread import CommThread
from gossip.backends.elastic_comm import _Interruptible, _InterruptibleExchange
from gossip.errors import MembershipChangedError, PeerFailedError, UseAfterCloseError


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


def comm_during_a_change(completing: bool, changing: bool = True, failure=None) -> types.SimpleNamespace:
    membership = types.SimpleNamespace(changed=threading.Event())
    if changing:
        membership.changed.set()
    return types.SimpleNamespace(membership=membership, rank=1, completing=completing, failure=failure)


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


def test_an_exchange_refused_after_an_earlier_failure_asks_for_the_change():
    """The race a dead store's host opens: a peer's exit fails the group while this rank's next exchange is queued."""
    thread = CommThread("test-comm", rank=1, timeout=5.0)
    try:
        started, release = threading.Event(), threading.Event()

        def failing(progress):
            started.set()
            release.wait(5.0)
            raise PeerFailedError("rank 1: peer 2 closed the connection")

        earlier = thread.submit("exchange 29 with peer(s) [2]", failing)
        started.wait(5.0)
        queued = thread.submit("exchange 30 with peer(s) []", lambda progress: None)  # posted before the failure
        release.set()
        with pytest.raises(PeerFailedError):
            earlier.wait()
        comm = comm_during_a_change(completing=False, changing=False, failure=thread.failure)
        with pytest.raises(UseAfterCloseError):
            _Interruptible(queued, comm).wait()  # what a collective's handle still says
        message = "rank 1: exchange 30 was not run: the group is broken by an earlier failure: rank 1: peer 2 closed"
        with pytest.raises(MembershipChangedError, match=message) as raised:
            _InterruptibleExchange(queued, comm, "exchange 30").wait()
        assert isinstance(raised.value.__cause__, UseAfterCloseError)
    finally:
        thread.stop(timeout=1.0)


def test_an_exchange_refused_on_a_healthy_group_stays_a_misuse():
    refused = PostedExchange()
    refused._future.set_exception(UseAfterCloseError("rank 1: exchange 30 refused: this communicator was closed"))
    with pytest.raises(UseAfterCloseError, match="was closed"):
        _InterruptibleExchange(refused, comm_during_a_change(completing=False, changing=False), "exchange 30").wait()
