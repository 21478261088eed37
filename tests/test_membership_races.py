"""Elastic membership's protocol on a real ``TCPStore``, in-process: orders of events that once broke it.

* The group-formation barrier (``Membership.await_group``): a member at the barrier has already published its ready
  key, so the others may see every key and start forming the Gloo group; from then on only the death of a member
  (or a failed store) may stop it. A join that starts the next epoch meanwhile must not (it would leave the others
  waiting the group's whole timeout); the join is taken at the next post.
* Two joins at once (``Membership.join``): the epoch that takes the first joiner in may be overtaken by the second
  joiner's epoch before the first looks; the first must still take its epoch (else the others wait for it at that
  epoch's barrier, and the next decision waits for its check-in, until both time out).
* A joiner that dies before it is taken in is left out of the decision (its ``dead`` key, set by the launcher, is
  read for it), rather than waited for at the barrier until the decision's timeout.
* The barrier has one outcome for every member: a member that sees no reason to stop follows the one that did
  (a silence only that one saw), instead of waiting for the absent member until the deadline.
* A worker restarted before the others decided its earlier process's departure (a silent death, not reported by a
  launcher) keeps silent in that process's name until the departure is decided, then joins with a hand-over
  (rather than keeping the dead process alive with its heartbeats and checking in as it, with a fresh replica).
* A death that only one member saw (a silence that ended with the silent member's check-in) is forgotten once the
  decision keeps that member: it neither stops the group's barrier on that member alone nor starts a change.

The tests drive the members' threads into these orders deterministically: through store clients that count a
member's polls or hold it at a chosen read, not with sleeps.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore

from gossip.backends.membership import Decision, Membership, host_store, mark_dead
from gossip.errors import InvalidArgumentError, MembershipChangedError, MembershipError

OPTIONS = {"interval": 0.05, "detect": 30.0, "decide_timeout": 40.0}
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


class HeldStore:
    """A store client that holds its owner at a read of ``epoch`` once the epoch reached ``at``, until released."""

    def __init__(self, store: TCPStore, at: int):
        self._store, self._at = store, at
        self.held, self.released = threading.Event(), threading.Event()

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        if key == "epoch" and int(value) >= self._at and not self.released.is_set():
            self.held.set()
            assert self.released.wait(WAIT), "never released"
            value = self._store.get(key)
        return value

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class SilentStore:
    """A store client whose owner's heartbeats are dropped while ``silent`` is set (a stalled, live worker)."""

    def __init__(self, store: TCPStore, uid: int):
        self._store, self._key = store, f"hb/{uid}"
        self.silent = threading.Event()

    def add(self, key: str, amount: int) -> int:
        if key == self._key and self.silent.is_set():
            return 0
        return self._store.add(key, amount)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class Call(threading.Thread):
    """``call()`` in a thread, keeping what it returned or raised."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self.call = call
        self.result = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.call()
        except BaseException as error:  # handed to the test
            self.error = error

    def outcome(self):
        self.join(WAIT)
        assert not self.is_alive(), f"{self.call} did not return within {WAIT:.0f} s"
        if self.error is not None:
            raise self.error
        return self.result


def form(members: list[Membership], decision: Decision) -> None:
    """Every member of ``decision`` passes its barrier, and its group is formed."""
    calls = [Call(lambda member=member: member.await_group(decision)) for member in members]
    for call in calls:
        call.outcome()
    for member in members:
        member.open(decision.first)


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
    barrier = Call(lambda: zero.await_group(decision))
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
        barrier.outcome()  # member 0 passes too

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
    barrier = Call(lambda: zero.await_group(decision))
    wait_until(lambda: store.check(["e1/ready/0"]), "member 0 is at the barrier with its ready key set")
    mark_dead(store, 1, "killed by SIGKILL")
    with pytest.raises(
        MembershipChangedError, match=r"epoch 1's group over \[0, 1\] was not formed: 1 \(killed by SIGKILL\)"
    ):
        barrier.outcome()
    assert int(store.get("epoch")) == 2  # member 0 started the next epoch


def test_a_joiner_takes_its_epoch_after_a_second_joiner_started_the_next(store, members):
    decision = decide_without_2(store, members)
    form(members, decision)

    # worker 2 restarts and asks to join; it starts epoch 2 and is held at its next look at the epoch
    first_store = HeldStore(client(store), at=2)
    first = Membership(first_store, 2, **OPTIONS)
    second = Membership(client(store), 3, **OPTIONS)
    try:
        first_join = Call(first.join)
        assert first_store.held.wait(WAIT), "the first joiner did not start epoch 2"
        taken = [member.decide() for member in members]  # epoch 2 takes the first joiner in
        assert taken[0] == taken[1] and taken[0].members == (0, 1, 2) and taken[0].joined == (2,)

        # before the first joiner looks again, worker 3 asks to join too, sees epoch 2 decided without it, and starts
        # epoch 3: the first joiner's epoch is no longer the current one when it looks
        second_join = Call(second.join)
        wait_until(lambda: int(store.get("epoch")) == 3, "the second joiner started epoch 3")
        first_store.released.set()
        assert first_join.outcome() == taken[0]

        form([*members, first], taken[0])  # epoch 2's group forms with the first joiner
        following = [member.decide() for member in (*members, first)]
        assert second_join.outcome() == following[0] == following[1] == following[2]
        assert following[0].epoch == 3 and following[0].members == (0, 1, 2, 3) and 3 in following[0].joined
    finally:
        first_store.released.set()
        first.close()
        second.close()


def test_a_joiner_that_dies_before_it_is_taken_in_is_left_out(store, members):
    decision = decide_without_2(store, members)
    form(members, decision)
    joiner_store = HeldStore(client(store), at=2)
    joiner = Membership(joiner_store, 2, **{**OPTIONS, "detect": 0.5, "decide_timeout": 1.0})
    try:
        join = Call(joiner.join)
        assert joiner_store.held.wait(WAIT), "the joiner did not start epoch 2"
        joiner.close()  # it dies after asking: its heartbeat stops and the launcher reports the exit
        mark_dead(store, 2, "killed by SIGKILL")

        decided = [member.decide() for member in members]
        assert decided[0] == decided[1] and decided[0].epoch == 2
        assert decided[0].members == (0, 1) and decided[0].joined == ()
        form(members, decided[0])  # at once: nobody waits for the dead joiner
    finally:
        joiner_store.released.set()
    with pytest.raises(MembershipError, match="member 2: not taken in"):
        join.outcome()


def test_a_death_only_one_member_saw_is_forgotten_once_the_decision_keeps_the_member(store):
    silent_store = SilentStore(client(store), 1)
    watcher = Membership(client(store), 0, **{**OPTIONS, "detect": 0.3})  # sees a silence of 0.3 s as a death
    members = [watcher, Membership(silent_store, 1, **OPTIONS), Membership(client(store), 2, **OPTIONS)]
    try:
        for member in members:
            member.open(0)  # epoch 0's group exists: silence is watched

        # member 1 stalls: member 0 alone declares it dead and starts epoch 1; every member checks in, 1 too
        silent_store.silent.set()
        wait_until(lambda: int(store.get("epoch")) == 1, "member 0 saw member 1 silent and started epoch 1")
        silent_store.silent.clear()
        assert all(member.changed.wait(WAIT) for member in members)
        decided = [members[1].decide(), members[2].decide(), watcher.decide()]  # member 1's proposal is written
        assert decided[0] == decided[1] == decided[2] and decided[0].members == (0, 1, 2)

        form(members, decided[0])  # member 0 does not leave the barrier on its own, stale, view of member 1
        beats = int(store.get("hb/0"))
        wait_until(lambda: int(store.get("hb/0")) >= beats + 10, "member 0's thread looked at the others 10 times")
        assert int(store.get("epoch")) == 1 and not watcher.changed.is_set(), "member 0 started a change again"
        assert watcher.try_post(decided[0].first)
    finally:
        for member in members:
            member.close()


def test_every_member_follows_the_barrier_stopped_on_one_members_view(store):
    silent_store = SilentStore(client(store), 2)
    watcher = Membership(client(store), 0, **{**OPTIONS, "detect": 0.3})  # sees a silence of 0.3 s as a death
    members = [watcher, Membership(client(store), 1, **OPTIONS), Membership(silent_store, 2, **OPTIONS)]
    try:
        for member in members:
            member.open(0)
        decided = [member.decide() for member in members]  # a change with nobody dead: epoch 1 keeps all three
        assert decided[0] == decided[1] == decided[2] and decided[0].members == (0, 1, 2)

        silent_store.silent.set()  # member 2 stalls before the barrier; only member 0 counts it dead
        barriers = [Call(lambda member=member: member.await_group(decided[0])) for member in members[:2]]
        with pytest.raises(MembershipChangedError, match=r"not formed: 2 \(silent for 0.3 s\) before it formed$"):
            barriers[0].outcome()
        with pytest.raises(MembershipChangedError, match=r"before it formed \(seen by member 0\)$"):
            barriers[1].outcome()  # member 1 follows at once (it would otherwise wait for member 2 until its deadline)
        assert int(store.get("epoch")) == 2 and members[1].changed.is_set()  # both go on to the next epoch
    finally:
        for member in members:
            member.close()


def test_a_worker_restarted_before_its_departure_is_decided_joins_after_it(store):
    watch = {**OPTIONS, "detect": 0.3}
    members = [Membership(client(store), uid, **watch) for uid in (0, 1)]
    earlier = Membership(client(store), 2, **watch)
    restarted = None
    try:
        for member in (*members, earlier):
            member.open(0)
        wait_until(lambda: int(store.get("hb/2")) > 0, "worker 2 heartbeated")
        earlier.close()  # worker 2 dies silently (no launcher reports it) and is started again at once
        restarted = Membership(client(store), 2, **watch)
        assert restarted.restarted and restarted.joining
        join = Call(restarted.join)

        assert all(member.changed.wait(WAIT) for member in members), "worker 2's silence was not noticed"
        departed = [member.decide() for member in members]
        assert departed[0] == departed[1] and departed[0].members == (0, 1)
        assert departed[0].left == {2: "silent for 0.3 s"}
        form(members, departed[0])

        assert all(member.changed.wait(WAIT) for member in members), "the restarted worker did not ask to join"
        joined = [member.decide() for member in members]
        assert join.outcome() == joined[0] == joined[1]
        assert joined[0].members == (0, 1, 2) and joined[0].joined == (2,)  # a joiner: it is handed its state
    finally:
        for member in (*members, earlier, *([restarted] if restarted else [])):
            member.close()


def test_a_silence_bound_past_the_decision_timeout_is_refused(store):
    """A decision waits for every live member's check-in; a silent member is live until ``detect`` has passed."""
    with pytest.raises(
        InvalidArgumentError, match=r"member 0: detect \(60.0 s\) must be positive and below decide_timeout"
    ):
        Membership(client(store), 0, **{**OPTIONS, "detect": 60.0, "decide_timeout": 60.0})


def test_the_decision_records_how_many_exchanges_of_the_step_each_member_posted(store, members):
    """A step with trackers has two exchanges: a member that posted both and one frozen before its second differ.

    Member 0 posts step 5's parameters' and trackers' exchanges, member 1 only the parameters' before the change
    freezes it. The decision says so, and :meth:`Decision.reached` compares (step, count) pairs: member 1 did not
    reach member 0's second exchange, so member 0 must not wait for it; member 0 reached member 1's one.
    """
    zero, one = members
    assert zero.try_post(5) and zero.try_post(5) and one.try_post(5)
    assert (zero.posted, zero.exchanges, one.posted, one.exchanges) == (5, 2, 5, 1)
    decision = decide_without_2(store, members)
    assert decision.posted == {0: 5, 1: 5} and decision.exchanges == {0: 2, 1: 1}
    assert not decision.reached(1, 5, 2) and decision.reached(0, 5, 1) and decision.reached(1, 5, 1)
    assert decision.reached(0, 4, 3) and not decision.reached(0, 6, 0)  # a later step is past every count
    for member in members:
        member.open(decision.first)
        assert member.exchanges == 0 and member.posted == decision.first - 1
        assert member.try_post(decision.first) and member.exchanges == 1
