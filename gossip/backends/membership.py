"""Elastic membership on a c10d ``TCPStore``: heartbeats, failure detection and one agreed member set per epoch.

The store is hosted outside the workers (by ``gossip-train --nproc N --elastic``, :func:`host_store`), so that any
worker may die. Keys (docs/ARCHITECTURE.md, "Elastic membership"):

* ``hb/<uid>``: a counter each member's background thread bumps every ``interval`` seconds;
* ``dead/<uid>`` and the counter ``deaths``: set by the launcher the moment a worker process exits unfinished;
* ``epoch``: the current epoch e; a member that sees a failure moves it to e + 1 (``compare_set``: once);
* ``e<e>/in/<uid>``: a member's check-in for epoch e: the last step whose exchange it posted on its last group,
  whether it still waits for its state (a joiner not yet handed its donor's replica), and how many exchanges of
  that step it posted (a step with gradient tracking has two: the parameters', then the trackers'; momentum
  tracking's sample of the mean gradient, an all-reduce, counts as one between them);
* ``joins`` and ``join/<k>``: joiners waiting for the next epoch (a joiner reads every epoch decided since its
  request: another joiner may have started the next epoch before it saw its own);
* ``e<e>/decision``: the epoch's members, every member's last posted step and its count of exchanges, the joiners
  and the group's first step, written once (first writer wins);
* ``e<e>/ready/<uid>``: a member of epoch e is at the formation of the epoch's group (:meth:`Membership.await_group`);
* ``e<e>/formation``: that barrier's one outcome, "form" or why it stopped (first writer wins);
* ``e<e>/end/<uid>`` and ``e<e>/ended``: the same at the end of the run (:meth:`Membership.await_end`).

A member *checks in* at most once per epoch, under the lock that posting takes (:meth:`Membership.try_post`):
from then on it posts nothing until its next group exists, so the check-in's posted step is final. The decision of
epoch e + 1 is written when every member of e has checked in or is dead (its ``dead`` key, or its heartbeat
unchanged for ``detect`` seconds); it lists the checked-in members that are not dead, in their order in e, then the
new joiners. Failure detection therefore takes at most ``interval`` when the launcher reports the exit,
``detect + interval`` otherwise.

**A change during a change.** Epoch e + 1's group may never form: a member dies between the decision and the
group's formation (while another member still catches up alone to the group's first step, or during the formation
itself). The members then check in for e + 2 from e + 1 -- a member that is still frozen checks in again, with the
same posted step, since it posted nothing since -- and e + 2 is decided as any epoch. Its first step is at least
e + 1's (members may already wait there), and a joiner that never received its state is a joiner again.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import TCPStore

from gossip.errors import InvalidArgumentError, MembershipChangedError, MembershipError

logger = logging.getLogger("gossip")

#: The environment variable that gives a worker the membership store, ``host:port``.
STORE_VARIABLE = "GOSSIP_ELASTIC_STORE"
#: Seconds without a heartbeat after which a member is declared dead, by default.
DETECT_SECONDS = 10.0
#: The outcome of a barrier on the store that every member passes (:meth:`Membership.await_group`, ``await_end``).
_FORM = "form"


def host_store(size: int, timeout: float = 300.0, port: int = 0) -> TCPStore:
    """Start the membership store (in the launcher) with epoch 0 of members ``0 .. size - 1``.

    Args:
        size: the members at the start.
        timeout: seconds a store operation may wait.
        port: the port to serve on (0: a free one); the store listens on every interface of this host, so that
            the launchers and workers of other nodes reach it.

    Returns:
        The hosting store; its ``port`` goes to the workers.
    """
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    store.set("epoch", "0")
    store.set("deaths", "0")
    store.set("joins", "0")
    store.set("e0/decision", json.dumps({"members": list(range(size)), "posted": {}, "joined": [], "first": 0}))
    for uid in range(size):
        store.set(f"hb/{uid}", "0")
    return store


def mark_dead(store: TCPStore, uid: int, how: str) -> None:
    """Record that worker ``uid`` exited unfinished (called by the launcher when it sees the exit).

    Args:
        store: the membership store.
        uid: the worker.
        how: how it ended, for the survivors' log line (e.g. "killed by SIGKILL").
    """
    store.set(f"dead_at/{uid}", repr(time.time()))
    store.set(f"dead/{uid}", how)
    store.add("deaths", 1)


@dataclass(frozen=True)
class Decision:
    """The member set of one epoch, as agreed.

    Attributes:
        epoch: the epoch.
        members: the uids, in rank order of the epoch's group.
        posted: for every member of the previous epoch that checked in: the last step it posted there (-1: none).
        exchanges: for the same members: how many exchanges of that step each posted.
        joined: the uids that joined at this epoch.
        left: the uids of the previous epoch that are not members, with how they ended.
        joins: the join requests taken into account so far (the store's ``joins`` counter then).
        first: the group's first step: at least one past every posted step, and at least the previous epoch's.
    """

    epoch: int
    members: tuple[int, ...]
    posted: dict[int, int]
    joined: tuple[int, ...]
    left: dict[int, str]
    joins: int = 0
    first: int = 0
    exchanges: dict[int, int] = field(default_factory=dict)

    def reached(self, uid: int, step: int, exchanges: int) -> bool:
        """Whether member ``uid`` had posted ``exchanges`` exchanges of ``step``, or a later step, at its check-in.

        Args:
            uid: a member of the previous epoch.
            step: a training step.
            exchanges: how many of that step's exchanges.

        Returns:
            True when its posted (step, count) is at least (``step``, ``exchanges``).
        """
        return (self.posted.get(uid, -1), self.exchanges.get(uid, 0)) >= (step, exchanges)


class Membership:
    """One worker's view of the membership: its heartbeat, its watch on the epoch, its part in each decision.

    Args:
        store: a client of the membership store.
        uid: this worker's identity.
        interval: seconds between heartbeats (and checks of the epoch and of the others' heartbeats).
        detect: seconds without a heartbeat after which a member is declared dead.
        decide_timeout: seconds a decision may take before :class:`MembershipError`; above ``detect``.

    Raises:
        InvalidArgumentError: ``detect`` is not in (0, ``decide_timeout``).
    """

    def __init__(
        self,
        store: TCPStore,
        uid: int,
        *,
        interval: float = 0.1,
        detect: float = DETECT_SECONDS,
        decide_timeout: float = 60.0,
    ):
        if not 0 < detect < decide_timeout:
            raise InvalidArgumentError(
                f"member {uid}: detect ({detect} s) must be positive and below decide_timeout ({decide_timeout} s): a "
                "decision waits for every live member's check-in, and a silent member is live until detect has passed"
            )
        self.store, self.uid = store, uid
        self.interval, self.detect, self.decide_timeout = interval, detect, decide_timeout
        self.epoch = int(store.get("epoch"))
        self.current = self._read_decision(self.epoch)
        self.posted = -1
        #: how many exchanges of step :attr:`posted` this member posted (module docstring: the parameters', the sample
        #: of the mean gradient, the trackers')
        self.exchanges = 0
        #: True from :meth:`join` until the joiner received its donor's state (:meth:`received_state`)
        self.needs_state = False
        #: set when this member has checked in for the next epoch (a change is under way)
        self.changed = threading.Event()
        self._lock = threading.Lock()
        self._frozen = False
        self._checked = self.epoch  # the latest epoch this member checked in for (or was decided into)
        self._deaths_read: dict[int, int] = {}  # uid -> the ``deaths`` count when its ``dead`` key was last read
        self._dead: dict[int, str] = {}
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._watching = False  # silence is watched once this member's first group exists (open())
        self._stop = threading.Event()
        self.error: BaseException | None = None
        #: an earlier process with this uid heartbeated (the store's counter starts at 0): this one was restarted
        self.restarted = int(store.add(f"hb/{uid}", 0)) > 0
        # Until the group decides the earlier process's departure, this one must neither heartbeat in its name (that
        # would keep it alive for the others' silence watch) nor check in as it (that would keep it a member, and this
        # process would join with a fresh replica and no hand-over): join() waits for the departure first.
        self._awaiting_departure = self.restarted and uid in self.current.members
        if not self._awaiting_departure:
            store.add(f"hb/{uid}", 1)
        self._thread = threading.Thread(target=self._loop, name=f"gossip-membership-{uid}", daemon=True)
        self._thread.start()

    # -- the background thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception as error:  # the store is gone (its host died): every later decision fails, named
                self.error = error
                self.changed.set()
                return

    def _tick(self) -> None:
        if self._awaiting_departure:
            return  # silent in the earlier process's name until its departure is decided (join())
        self.store.add(f"hb/{self.uid}", 1)
        if self.uid not in self.current.members:
            return  # joining: join() follows the epochs itself
        epoch = int(self.store.get("epoch"))
        if epoch > self.epoch:
            self._check_in(self.epoch + 1)
        elif not self._frozen and self.dead(self.current.members):
            self.request_change()

    def dead(self, uids: tuple[int, ...]) -> dict[int, str]:
        """The members among ``uids`` that are dead: reported by the launcher, or silent for ``detect`` seconds.

        Args:
            uids: the members to look at.

        Returns:
            uid -> how it was found dead.
        """
        deaths = int(self.store.get("deaths"))
        for uid in uids:  # each uid's key is read again after every new death, whichever uids an earlier call asked
            if uid not in self._dead and self._deaths_read.get(uid) != deaths:
                self._deaths_read[uid] = deaths
                if self.store.check([f"dead/{uid}"]):
                    self._dead[uid] = self.store.get(f"dead/{uid}").decode()
        now = time.monotonic()
        others = [uid for uid in uids if uid != self.uid] if self._watching else []
        for uid, value in zip(others, self.store.multi_get([f"hb/{uid}" for uid in others]) if others else [],
                              strict=True):  # fmt: skip
            last = self._seen.get(uid)
            if last is None or last[0] != value:
                # silence counts from a change seen by this member: not before a worker's first heartbeat (it may
                # still be starting), nor across this member's own stalls (see open())
                self._seen[uid] = (value, now if value != b"0" else math.inf)
            elif now - last[1] >= self.detect and uid not in self._dead:
                self._dead[uid] = f"silent for {self.detect:.1f} s"
        return {uid: self._dead[uid] for uid in uids if uid in self._dead}

    # -- the main thread ------------------------------------------------------------------------------------
    def try_post(self, step: int) -> bool:
        """Record that this member posts the exchange of ``step`` on the current group, unless it checked in.

        Args:
            step: the training step whose exchange is about to be posted.

        Returns:
            False when a change is under way: post nothing on the old group.
        """
        with self._lock:
            if self._frozen:
                return False
            if step != self.posted:
                self.posted, self.exchanges = step, 0
            self.exchanges += 1
            return True

    def _check_in(self, epoch: int) -> None:
        with self._lock:
            if epoch <= self._checked:
                return
            self._frozen, self._checked = True, epoch
            self.store.set(f"e{epoch}/in/{self.uid}", json.dumps([self.posted, self.needs_state, self.exchanges]))
        self.changed.set()

    def request_change(self) -> None:
        """Start epoch e + 1 (a peer failed): move the store's epoch once, and check in.

        An unreachable store is not raised here but kept (as the heartbeat thread keeps it): the decision that
        follows raises the :class:`MembershipError` that names it.
        """
        try:
            self.store.compare_set("epoch", str(self.epoch), str(self.epoch + 1))
            self._check_in(self.epoch + 1)
        except Exception as error:  # TCPStore raises plain RuntimeErrors / DistNetworkErrors when its host is gone
            self.error = error
            self.changed.set()

    def decide(self) -> Decision:
        """Check in (if not yet), help write the next epoch's decision, and return it (posting stays off: :meth:`open`).

        Returns:
            The decision of epoch e + 1.

        Raises:
            MembershipError: no decision within ``decide_timeout``, the store is unreachable, or this member is not
                in the decision (it was declared dead while alive).
        """
        epoch = self.epoch + 1
        key, deadline = f"e{epoch}/decision", time.monotonic() + self.decide_timeout
        try:
            if self.error is not None:
                raise MembershipError(f"member {self.uid}: the membership thread failed: {self.error}")
            self.request_change()
            while not self.store.check([key]):
                if time.monotonic() > deadline:
                    raise MembershipError(
                        f"member {self.uid}: no decision on epoch {epoch}'s members within {self.decide_timeout:.0f} s "
                        f"(members of epoch {self.epoch}: {list(self.current.members)})"
                    )
                self._propose(epoch)
                time.sleep(self.interval / 4)
            decision = self._read_decision(epoch)
        except MembershipError as error:
            if self.error is None:
                raise
            raise MembershipError(self._store_lost(epoch)) from error
        except Exception as error:  # TCPStore raises plain RuntimeErrors / DistStoreErrors when its host is gone
            raise MembershipError(self._store_lost(epoch)) from error
        if self.uid not in decision.members:
            raise MembershipError(
                f"member {self.uid}: left out of epoch {epoch} (members {list(decision.members)}): it was declared "
                f"dead while alive; restart this worker with the same command to join again"
            )
        with self._lock:  # still frozen: nothing is posted until the new group exists (open())
            self.epoch, self.current = epoch, decision
            self.changed.clear()
        # every member the decision keeps is alive as far as the group knows: a death only this member saw (a
        # silence that ended with a check-in) must not stop the group's barrier on it alone, nor start a change
        self._forget(decision.members)
        return decision

    def _forget(self, uids: tuple[int, ...]) -> None:
        """Members decided alive (kept, or joined again): drop what was known of their death and heartbeat.

        A ``dead`` key set meanwhile is read again at the next look, and silence counts afresh from now.
        """
        for uid in uids:
            self._dead.pop(uid, None)
            self._seen.pop(uid, None)
            self._deaths_read.pop(uid, None)

    @property
    def joining(self) -> bool:
        """Whether this worker must join: not a current member, or restarted (declared dead, or :attr:`restarted`)."""
        return self.uid not in self.current.members or self.restarted or self.store.check([f"dead/{self.uid}"])

    def join(self) -> Decision:
        """Ask to join and wait for the epoch that takes this worker in (a new epoch is started for it).

        Returns:
            The decision of the epoch this worker joins.

        Raises:
            MembershipError: not taken in within ``decide_timeout``, or the store is unreachable.
        """
        deadline = time.monotonic() + self.decide_timeout
        try:
            if self._awaiting_departure:
                self._await_departure(deadline)
            if self.store.check([f"dead/{self.uid}"]):
                self.store.delete_key(f"dead/{self.uid}")
            # read before asking: a decision is written while its epoch is the store's, so none before this one
            # can hold the request
            examined = int(self.store.get("epoch"))
            index = self.store.add("joins", 1) - 1
            self.store.set(f"join/{index}", str(self.uid))
            while True:
                decision, examined = self._decision_taking(index, examined)
                if decision is not None:
                    break
                if time.monotonic() > deadline:
                    raise MembershipError(
                        f"member {self.uid}: not taken in within {self.decide_timeout:.0f} s of asking to join"
                    )
                time.sleep(self.interval / 4)
        except MembershipError:
            raise
        except Exception as error:  # the store's host is gone
            self.error = error
            raise MembershipError(self._store_lost(self.epoch + 1)) from error
        epoch = decision.epoch
        with self._lock:
            self.epoch, self.current, self._frozen, self.posted, self.exchanges = epoch, decision, True, -1, 0
            self._checked, self.needs_state = max(self._checked, epoch), True
            self.changed.clear()
        self._forget(decision.joined)
        return decision

    def _await_departure(self, deadline: float) -> None:
        """Wait, silent, until an epoch is decided without the earlier process of this uid; then heartbeat."""
        while True:
            epoch = int(self.store.get("epoch"))
            if self.store.check([f"e{epoch}/decision"]) and self.uid not in self._read_decision(epoch).members:
                break
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"member {self.uid}: restarted, but the group did not decide the earlier process's departure "
                    f"within {self.decide_timeout:.0f} s (it is still a member of epoch {epoch}): is another process "
                    f"with this uid (RANK={self.uid}) still running?"
                )
            time.sleep(self.interval / 4)
        self.store.add(f"hb/{self.uid}", 1)
        self._awaiting_departure = False

    def _decision_taking(self, index: int, examined: int) -> tuple[Decision | None, int]:
        """The first decided epoch from ``examined`` on that takes join request ``index`` in, if any yet.

        The epoch that takes a joiner in may already be overtaken when the joiner looks (another joiner, finding it
        decided without its own request, started the next), so every epoch decided since the request is read, oldest
        first; every epoch before the store's current one is decided (the epoch moves on only past a decision). The
        current epoch, decided without this request, is moved on for it.

        Returns:
            The decision (None: not yet), and the first epoch not yet examined.
        """
        epoch = int(self.store.get("epoch"))
        while examined <= epoch and self.store.check([f"e{examined}/decision"]):
            found = self._read_decision(examined)
            if self.uid in found.members and index < found.joins:
                return found, examined
            if examined == epoch and index >= found.joins:
                self.store.compare_set("epoch", str(epoch), str(epoch + 1))
            examined += 1
        return None, examined

    def _store_lost(self, epoch: int) -> str:
        return (
            f"member {self.uid}: the membership store is unreachable during epoch {epoch}'s decision "
            f"({self.error or 'no answer'}); the store's host (the launcher) is gone: the job cannot continue, restart "
            "it from its last checkpoint"
        )

    def open(self, first: int) -> None:
        """The new epoch's group exists: posting is allowed again, unless the next change is already under way.

        Args:
            first: the group's first step (the posted step is ``first - 1`` until the first exchange is posted).
        """
        with self._lock:
            self._watching = True
            if self._checked <= self.epoch:  # else checked in for the next epoch meanwhile: stay frozen
                self.posted, self.exchanges = first - 1, 0
                self._frozen = False
        self.restart_silence_watch()

    def restart_silence_watch(self) -> None:
        """Count the others' silence afresh from now (after this member's own stall, e.g. forming a group).

        Forming a Gloo group can hold the interpreter for seconds (on every member, up to the group's timeout when
        a member never arrives): heartbeats missed meanwhile are no sign of death.
        """
        self._seen.clear()

    def received_state(self) -> None:
        """A joiner received its donor's state: a later check-in no longer asks for it."""
        with self._lock:
            self.needs_state = False

    def await_group(self, decision: Decision) -> None:
        """Wait until every member of ``decision`` is at the formation of its group (a barrier on the store).

        Forming a Gloo group with a member that is gone waits for the group's whole timeout; this barrier notices
        the death at once instead: the caller then decides the next epoch (:meth:`decide`). The barrier's outcome is
        one for all members: the first to see every member arrived writes "form", the first to see a reason to stop
        (a dead member, the deadline) writes why, on the store's key ``e<e>/formation`` (``compare_set``: once), and
        every member follows what is written. Without that, a member that stopped on its own view (a silence only it
        saw, its own deadline) after setting its ready key would leave the others forming the group without it.
        A change that removes no member (a joiner starting the next epoch) does not stop the barrier: the group
        forms, and the change is taken at the next post (the background check-in for the next epoch froze posting).

        Args:
            decision: the epoch whose group is about to be formed.

        Raises:
            MembershipChangedError: the barrier stopped on a dead member (or the store failed): the group will not
                form; decide the next epoch.
            MembershipError: not every member arrived within ``decide_timeout``, or the store is unreachable.
        """
        epoch, members = decision.epoch, decision.members
        deadline = time.monotonic() + self.decide_timeout
        stop = self._barrier(f"e{epoch}/ready", members, f"e{epoch}/formation", epoch,
                             lambda: self._reason_to_stop(decision, deadline))  # fmt: skip
        if stop is None:
            return
        message = self._stopped(f"epoch {epoch}'s group over {list(members)} was not formed", stop)
        if stop["timeout"]:
            raise MembershipError(message)
        self.request_change()
        raise MembershipChangedError(message)

    def await_end(self, deadline_seconds: float) -> bool:
        """At the end of the run: meet the current epoch's other members on the store, with one outcome for all.

        Like :meth:`await_group`'s barrier (keys ``e<e>/end/<uid>``, outcome ``e<e>/ended``): True when every member
        arrived; False when a change is under way first (a death, or a join, in the run's last steps, which some
        members may notice only after their loop ended): resolve it and enter its epoch, then meet again there.

        Args:
            deadline_seconds: how long to wait for the others at most.

        Returns:
            Whether every member of the epoch ended with this one.

        Raises:
            MembershipError: not every member arrived within ``deadline_seconds`` (and no change started), or the
                store is unreachable.
        """
        epoch, members = self.epoch, self.current.members
        deadline = time.monotonic() + deadline_seconds

        def reason() -> dict[str, Any] | None:
            if self.changed.is_set() or self.error is not None:
                return {"by": self.uid, "why": "a membership change is under way", "timeout": False}
            if time.monotonic() > deadline:
                return {"by": self.uid, "why": f"not every member ended within {deadline_seconds:.0f} s",
                        "timeout": True}  # fmt: skip
            return None

        stop = self._barrier(f"e{epoch}/end", members, f"e{epoch}/ended", epoch, reason)
        if stop is not None and stop["timeout"]:
            raise MembershipError(
                self._stopped(f"epoch {epoch}'s members {list(members)} did not all reach the end of the run", stop)
            )
        return stop is None

    def _stopped(self, what: str, stop: dict[str, Any]) -> str:
        """The message of a barrier that ``stop`` ended: ``what`` happened, why, and who saw it (if another member)."""
        seen = f" (seen by member {stop['by']})" if stop["by"] != self.uid else ""
        return f"member {self.uid}: {what}: {stop['why']}{seen}"

    def _barrier(
        self,
        prefix: str,
        members: tuple[int, ...],
        outcome_key: str,
        epoch: int,
        reason: Callable[[], dict[str, Any] | None],
    ) -> dict[str, Any] | None:
        """A barrier of ``members`` on the store with one outcome: None when all arrived, else why it stopped.

        Each member sets ``<prefix>/<uid>``; the first to see every key writes "form" to ``outcome_key``, the first
        to find a ``reason()`` to stop writes it there (``compare_set``: once); every member follows what is written.
        """
        keys = [f"{prefix}/{uid}" for uid in members]
        try:
            self.store.set(f"{prefix}/{self.uid}", "1")
            while True:
                if self.store.check(keys):
                    outcome = self.store.compare_set(outcome_key, "", _FORM)
                elif self.store.check([outcome_key]):
                    outcome = self.store.get(outcome_key)
                else:
                    if self.error is not None:
                        raise MembershipChangedError(
                            f"member {self.uid}: epoch {epoch}'s members {list(members)} did not meet: the membership "
                            "store failed"
                        )
                    stop = reason()
                    if stop is None:
                        time.sleep(self.interval / 4)
                        continue
                    outcome = self.store.compare_set(outcome_key, "", json.dumps(stop))
                break
        except (MembershipChangedError, MembershipError):
            raise
        except Exception as error:  # the store's host is gone
            raise MembershipError(self._store_lost(epoch)) from error
        return None if outcome == _FORM.encode() else json.loads(outcome)

    def _reason_to_stop(self, decision: Decision, deadline: float) -> dict[str, Any] | None:
        """Why this member would stop the barrier of ``decision`` now (None: keep waiting), as written to the store."""
        dead = self.dead(decision.members)
        if dead:
            why = f"{', '.join(f'{uid} ({how})' for uid, how in sorted(dead.items()))} before it formed"
            return {"by": self.uid, "why": why, "timeout": False}
        if time.monotonic() > deadline:
            epoch = decision.epoch
            missing = [uid for uid in decision.members if not self.store.check([f"e{epoch}/ready/{uid}"])]
            why = f"members {missing} did not arrive at its formation within {self.decide_timeout:.0f} s"
            return {"by": self.uid, "why": why, "timeout": True}
        return None

    def _propose(self, epoch: int) -> None:
        old = self.current.members
        checked = [uid for uid in old if self.store.check([f"e{epoch}/in/{uid}"])]
        dead = self.dead(old)
        if set(old) - set(checked) - set(dead):
            return  # a live member has not checked in yet
        joins = int(self.store.get("joins"))
        fresh = range(self.current.joins, joins)  # join requests not yet taken by an earlier decision
        asked = sorted({int(self.store.get(f"join/{k}")) for k in fresh} - set(old))
        # a joiner deletes its ``dead`` key before asking (a restarted worker has one): one there now died since
        joiners = [uid for uid in asked if not self.store.check([f"dead/{uid}"])]
        members = [uid for uid in old if uid in checked and uid not in dead] + joiners
        check_ins = {uid: json.loads(self.store.get(f"e{epoch}/in/{uid}")) for uid in checked}
        posted = {uid: step for uid, (step, _, _) in check_ins.items()}
        exchanges = {uid: count for uid, (_, _, count) in check_ins.items()}
        waiting = [uid for uid in members if uid in check_ins and check_ins[uid][1]]  # joiners still without state
        first = max([self.current.first] + [step + 1 for step in posted.values()])
        left = {uid: dead.get(uid, "left") for uid in old if uid not in members}
        text = json.dumps({"members": members, "posted": posted, "exchanges": exchanges, "joined": waiting + joiners,
                           "left": left, "joins": joins, "first": first})  # fmt: skip
        self.store.compare_set(f"e{epoch}/decision", "", text)

    def _read_decision(self, epoch: int) -> Decision:
        data = json.loads(self.store.get(f"e{epoch}/decision"))
        return Decision(
            epoch=epoch,
            members=tuple(data["members"]),
            posted={int(uid): step for uid, step in data["posted"].items()},
            joined=tuple(data["joined"]),
            left={int(uid): how for uid, how in data.get("left", {}).items()},
            joins=data.get("joins", 0),
            first=data.get("first", 0),
            exchanges={int(uid): count for uid, count in data.get("exchanges", {}).items()},
        )

    def exit_time(self, uid: int) -> float | None:
        """When the launcher saw member ``uid`` exit (wall clock, seconds since the epoch), if it did.

        Args:
            uid: a member.

        Returns:
            The time, or None when the launcher did not report it (a silent member).
        """
        key = f"dead_at/{uid}"
        return float(self.store.get(key)) if self.store.check([key]) else None

    def close(self) -> None:
        """Stop the heartbeat (at the end of the run: the others are done too)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1.0)


def connect(address: str, uid: int, timeout: float = 60.0, **options: float) -> Membership:
    """Join the membership store at ``address`` (``host:port``) as ``uid``.

    Args:
        address: the store, as :data:`STORE_VARIABLE` gives it.
        uid: this worker's identity.
        timeout: seconds a store operation may wait.
        **options: ``interval``, ``detect``, ``decide_timeout`` of :class:`Membership`.

    Returns:
        This worker's membership.

    Raises:
        MembershipError: the store cannot be reached.
    """
    host, port = address.rsplit(":", 1)
    try:
        store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except Exception as error:  # c10d raises DistNetworkError / RuntimeError
        raise MembershipError(f"member {uid}: cannot reach the membership store at {address}: {error}") from error
    return Membership(store, uid, **options)
