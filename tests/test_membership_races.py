"""The group-formation barrier of elastic membership (``Membership.await_group``), on a real ``TCPStore``, in-process.

A member at the barrier has already published its ready key, so the others may see every key and start forming the
Gloo group: from then on only the death of a member (or a failed store) may stop it. A join that starts the next
epoch meanwhile must not (it would leave the others waiting the group's whole timeout); the join is taken at the
next post. These tests drive the members' threads into that order deterministically: the member at the barrier is
observed polling through a counting store, not timed with sleeps.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore

from gossip.backends.membership import Decision, Membership, host_store, mark_dead
from gossip.errors import MembershipChangedError

OPTIONS = {"interval": 0.05, "detect": 30.0, "decide_timeout": 20.0}
WAIT = 20.0  # seconds any awaited event may take before the test fails (it normally takes milliseconds)


class CountingStore:
    """A store client that counts ``check`` calls on one set of keys (a member's polls at a barrier)."""

    def __init__(self, store: TCPStore, watched: list[str]):
        self._store, self._watched = store, watched
        self.polls = 0

    def check(self, keys: list[str]) -> bool:
        if keys == self._watched:
            self.polls += 1
        return self._store.check(keys)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class Barrier(threading.Thread):
    """``member.await_group(decision)`` in a thread, keeping what it raised."""

    def __init__(self, member: Membership, decision: Decision):
        super().__init__(daemon=True)
        self.member, self.decision = member, decision
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.member.await_group(self.decision)
        except BaseException as error:  # handed to the test
            self.error = error


def client(store: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=WAIT))


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


@pytest.fixture
def store() -> TCPStore:
    return host_store(3)


@pytest.fixture
def members(store: TCPStore) -> Iterator[list[Membership]]:
    """Members 0 and 1 of epoch 0's [0, 1, 2]; member 2 exits unfinished, so they decide epoch 1 = [0, 1]."""
    found = [Membership(client(store), uid, **OPTIONS) for uid in (0, 1)]
    yield found
    for member in found:
        member.close()


def decide_without_2(store: TCPStore, members: list[Membership]) -> Decision:
    mark_dead(store, 2, "killed by SIGKILL")
    decisions = [member.decide() for member in members]
    assert decisions[0] == decisions[1]
    assert decisions[0].epoch == 1 and decisions[0].members == (0, 1) and decisions[0].left == {2: "killed by SIGKILL"}
    return decisions[0]


def test_a_join_during_the_formation_barrier_waits_for_the_group(store, members):
    zero, one = members
    decision = decide_without_2(store, members)
    ready_keys = [f"e1/ready/{uid}" for uid in decision.members]
    zero.store = counting = CountingStore(zero.store, ready_keys)
    barrier = Barrier(zero, decision)
    barrier.start()
    wait_until(lambda: store.check(["e1/ready/0"]), "member 0 is at the barrier with its ready key set")

    # worker 2 restarts and asks to join: it starts epoch 2, and members 0 and 1 check in for it
    joiner = Membership(client(store), 2, **OPTIONS)
    try:
        joined: list[Decision] = []
        join = threading.Thread(target=lambda: joined.append(joiner.join()), daemon=True)
        join.start()
        assert zero.changed.wait(WAIT) and one.changed.wait(WAIT), "the join did not start epoch 2"
        assert int(store.get("epoch")) == 2

        # member 0 keeps polling the barrier with the change under way (the fault left it after one poll)
        polls = counting.polls
        wait_until(lambda: counting.polls >= polls + 3 or not barrier.is_alive(), "member 0 polled the barrier again")
        assert barrier.is_alive() and barrier.error is None, f"member 0 left the barrier: {barrier.error!r}"

        one.await_group(decision)  # member 1 arrives: both pass
        barrier.join(WAIT)
        assert not barrier.is_alive() and barrier.error is None, f"member 0's barrier ended with {barrier.error!r}"

        # the group of epoch 1 exists, but both checked in for epoch 2: they post nothing on it, and take the join next
        for member in members:
            member.open(decision.first)
            assert not member.try_post(decision.first)
        following = [member.decide() for member in members]
        join.join(WAIT)
        assert joined == [following[0]] == [following[1]]
        assert following[0].epoch == 2 and following[0].members == (0, 1, 2) and 2 in following[0].joined
    finally:
        joiner.close()


def test_a_death_at_the_formation_barrier_stops_it_and_names_the_member(store, members):
    zero, _ = members
    decision = decide_without_2(store, members)
    barrier = Barrier(zero, decision)
    barrier.start()
    wait_until(lambda: store.check(["e1/ready/0"]), "member 0 is at the barrier with its ready key set")
    mark_dead(store, 1, "killed by SIGKILL")
    barrier.join(WAIT)
    assert isinstance(barrier.error, MembershipChangedError)
    assert "epoch 1's group over [0, 1] was not formed: 1 (killed by SIGKILL)" in str(barrier.error)
    assert int(store.get("epoch")) == 2  # member 0 started the next epoch
