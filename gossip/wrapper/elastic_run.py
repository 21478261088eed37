"""Elastic gossip with real processes: survive a dead peer, agree on the survivors, rebuild, train on.

:class:`ElasticRun` drives one worker's wrapper through membership changes (:mod:`gossip.backends.membership`,
:mod:`gossip.backends.elastic_comm`). The training loop calls :meth:`ElasticRun.before_step` at the top of each
step and :meth:`ElasticRun.update` instead of ``optimizer.step()``. When a peer dies, the first wait that notices
(Gloo's "connection closed", or the membership's interruption) raises inside ``optimizer.step()``; ``update``
catches it, takes part in the decision of the next epoch, resolves the step in flight, and completes the update.

**A mixing step with a peer that died or left mid-exchange is completed or skipped on both ends, never on one.**
Real-process elastic runs need a schedule with at most one partner per rank and step (in-peer = out-peer:
``one_peer_hypercube``, ``base_graph``, ``one_peer_ring``, ``random_matchings``) and an algorithm whose step is one
exchange (``ExactGossip``, ``PowerGossip`` with one iteration). For the step s a rank was in (its exchange posted,
or not):

* *completed* when its partner is a member of the new epoch and posted its own step-s exchange (the decision holds
  every member's last posted step): both posted, neither abandons a posted transfer, so both ends apply it;
* *skipped* otherwise (the partner is dead, or never posted s: it cannot post it any more): the rank keeps x_s and
  applies its update without mixing; the partner did not apply it either (it is dead, or never posted).

The new group starts at R = 1 + the highest step any member posted; a member behind R trains alone (identity mixing,
a one-rank group) until it reaches R. A partner of a completed step that dies before its message arrived turns the
step into a skipped one on this end (the dead end does not matter); a further change (a join, another death) does
not interrupt the completed step's wait, since its live partner applies the step. At R the members meet on the store
(:meth:`~gossip.backends.membership.Membership.await_group`) and form the group; if a member dies before the group
is formed (while another catches up, or during the formation or the hand-over), the survivors decide the next epoch
at once and form that one instead, starting at R or later (a change during a change: the survivors' step in flight
was already resolved, nobody posted anything since). Everyone then rebinds (:func:`gossip.wrapper.elastic.rebind`:
schedule of the same family over the new size or its named fallback, fresh per-edge state) and logs one line naming
who left, at which step, and the new schedule. Failure detection takes at most the membership's ``interval`` when
the launcher reports the exit (``gossip-train --nproc N --elastic``), ``detect + interval`` otherwise; the
re-formation adds one Gloo group creation (a member that dies after the others passed
:meth:`~gossip.backends.membership.Membership.await_group` costs the group's timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gossip.algorithms.base import Algorithm
from gossip.algorithms.choco_sign import ChocoSign
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.backends.elastic_comm import ElasticCommunicator, open_epoch
from gossip.backends.membership import Decision, Membership
from gossip.errors import (
    CommTimeoutError,
    ElasticUnsupportedError,
    MembershipChangedError,
    MembershipError,
    PeerFailedError,
    UseAfterCloseError,
)
from gossip.wrapper.elastic import (
    choose_donor,
    hand_over,
    rebind,
    schedule_for,
    solo_communicator,
    without_schedule_checks,
)
from gossip.wrapper.mean_gradient import GossipedMeanGradient
from gossip.wrapper.momentum import check_optimizer_agreement
from gossip.wrapper.parallel import DecentralizedDataParallel
from topologies import Schedule

logger = logging.getLogger("gossip")

#: What a wait raises when a peer is gone or a change is under way: the step is resolved, not failed.
CHANGE_SIGNALS = (MembershipChangedError, PeerFailedError, CommTimeoutError)


@dataclass(frozen=True)
class _Change:
    """A decided change not yet entered: the epoch, its group's first step, and what the log line reports."""

    decision: Decision
    first: int
    started: float
    noticed_at: int
    outcome: str
    left: dict[int, str] = field(default_factory=dict)  # every departure since the last formed group


def check_supported(schedule: Schedule, algorithm: Algorithm) -> None:
    """Refuse what real-process elastic runs cannot keep consistent (see the module docstring).

    Args:
        schedule: the schedule of an epoch.
        algorithm: the algorithm.

    Raises:
        ElasticUnsupportedError: a rank has several partners at a step, or different in- and out-peers; or the
            algorithm's step is not one exchange.
    """
    for step in schedule.check_steps:
        for rank in range(schedule.n):
            view = schedule.peers(rank, step)
            ins, outs = {p for p, _ in view.in_peers}, {p for p, _ in view.out_peers}
            if len(ins) > 1 or ins != outs:
                raise ElasticUnsupportedError(
                    f"elastic: schedule '{schedule.name}' gives rank {rank} the partners {sorted(ins | outs)} at "
                    f"step {step}; elastic runs need one partner per step (one_peer_hypercube, base_graph, "
                    "one_peer_ring, random_matchings), so that a step with a dead peer is skipped on both ends"
                )
    one_exchange = isinstance(algorithm, ExactGossip | PowerGossip | ChocoSign)
    if not one_exchange or getattr(algorithm, "num_iterations", 1) != 1:
        raise ElasticUnsupportedError(
            f"elastic: algorithm {type(algorithm).__name__} is not supported on real processes (its step is not one "
            "exchange); use ExactGossip, PowerGossip with num_iterations=1 or ChocoSign"
        )


def check_wrapper(model: DecentralizedDataParallel) -> None:
    """Refuse a wrapper that runs a collective inside ``optimizer.step()`` after the update.

    A membership change can interrupt such a collective once the step's mixing and update are applied; the step
    could then not be resolved without applying the update again (on its retry, and once more alone).

    Args:
        model: the wrapper.

    Raises:
        ElasticUnsupportedError: it samples the consensus distance every few steps, averages its buffers every
            step, overlaps its trackers' exchange or runs it several times a step.
    """
    rank = model.comm.rank
    if model.consensus_every > 0:
        raise ElasticUnsupportedError(
            f"elastic: rank {rank}: the wrapper samples the consensus distance every {model.consensus_every} steps, "
            "an all-reduce inside optimizer.step() that a membership change could interrupt after the update; build "
            "it with consensus_every=0 and measure between steps with ElasticRun.consensus_distance()"
        )
    if model.buffers_policy == "average":
        raise ElasticUnsupportedError(
            f"elastic: rank {rank}: buffers='average' all-reduces the buffers inside optimizer.step(), which a "
            "membership change could interrupt after the update; use buffers='local'"
        )
    if model.tracker is not None and model.tracker.overlap:
        raise ElasticUnsupportedError(
            f"elastic: rank {rank}: tracking_overlap=True posts the trackers' exchange beside the parameters' (two "
            "exchanges a step, which the completed-or-skipped rule does not cover); use the blocking tracker"
        )
    if model.tracker is not None and model.tracker.hops > 1:
        raise ElasticUnsupportedError(
            f"elastic: rank {rank}: tracker_hops={model.tracker.hops} runs the trackers' exchange {model.tracker.hops} "
            "times a step, which the completed-or-skipped rule (one exchange after the mixing) does not cover; build "
            "the wrapper with tracker_hops=1"
        )
    if isinstance(model._mean_gradient, GossipedMeanGradient):
        raise ElasticUnsupportedError(
            f"elastic: rank {rank}: mean_gradient='gossip' posts the sample's hops beside the parameters' exchange "
            "(two exchanges a step, which the completed-or-skipped rule does not cover); build the wrapper with "
            "mean_gradient='allreduce', whose sample a change skips"
        )


class ElasticRun:
    """One worker's elastic driver (see the module docstring).

    Args:
        model: the wrapper, built over epoch 0's :class:`ElasticCommunicator`.
        optimizer: its optimizer.
        membership: this worker's membership.
        schedule: the schedule family, rebuilt at every change.
        algorithm: makes a fresh, unbound algorithm (configured as the one in ``model``).
        timeout: the Gloo groups' wait bound, and their creation's.
        tracker: with gradient tracking, makes a fresh, unbound algorithm for the trackers (needed only when the
            wrapper's ``gradient_tracking`` was an algorithm object; a name remakes itself).

    Gradient tracking: at every change each member restarts its tracker at its own last input
    (:func:`gossip.wrapper.elastic.rebind`), which keeps the trackers' sum equal to the members' gradients. A
    step's trackers' exchange is completed or skipped like its parameters' (a wait on it that a change interrupts
    resumes on the step's old group when the step is completed there, else the trackers restart and the step's
    remainder runs alone). Momentum tracking's sample of the mean gradient (:class:`optim.MomentumTrackingAdamW`
    with ``second_moment_every`` > 0, an all-reduce between the parameters' and the trackers' exchanges) is posted
    like them and attempted once: a member whose sample a change interrupts or refuses takes none that step (its
    second moment waits for the next sample), while a member whose all-reduce completed keeps it; each member's
    second moment is its own state, which the members need not share exactly. A step that runs alone samples its
    own gradient, as a one-rank group does.

    Raises:
        ElasticUnsupportedError: the schedule, the algorithm (the parameters' or the trackers') or the wrapper cannot
            run elastic (see :func:`check_supported` and :func:`check_wrapper`).
    """

    def __init__(
        self,
        model: DecentralizedDataParallel,
        optimizer: torch.optim.Optimizer,
        membership: Membership,
        *,
        schedule: str,
        algorithm: Callable[[], Algorithm],
        timeout: float,
        tracker: Callable[[], Algorithm] | None = None,
    ):
        check_supported(model.schedule, model.algorithm)
        if model.tracker is not None:
            check_supported(model.schedule, model.tracker.mixing)
        check_wrapper(model)
        without_schedule_checks(model)  # no collective inside a step that a change could interrupt
        if model.tracker is not None and not model._optimizer_agreed:  # once, before any change can interrupt it
            check_optimizer_agreement(model.comm, optimizer, model.step_count)
            model._optimizer_agreed = True
        self.model, self.optimizer, self.membership = model, optimizer, membership
        self.schedule_name, self.make_algorithm, self.timeout = schedule, algorithm, timeout
        self.make_tracker = tracker
        #: one dict per membership change, for the run's summary
        self.events: list[dict[str, Any]] = []
        #: the membership a loaded checkpoint recorded (see :meth:`load_state_dict`), else None
        self.restored: dict[str, Any] | None = None
        self._comm: ElasticCommunicator | None = model.comm if isinstance(model.comm, ElasticCommunicator) else None
        self._pending: _Change | None = None
        #: the uids of the group the wrapper is bound to, in rank order (this worker alone while behind R)
        self.group: tuple[int, ...] = membership.current.members
        #: the group of the last completed mixing step (what its schedule ran over)
        self.last_group: tuple[int, ...] = self.group
        if self._comm is not None:
            membership.open(model.step_count)  # the first group exists: silence is watched from now on

    @property
    def members(self) -> tuple[int, ...]:
        """The uids of the current epoch, in rank order."""
        return self.membership.current.members

    def step_of(self) -> int:
        """The step the wrapper is at (what an exchange posted now belongs to).

        Returns:
            The wrapper's step count.
        """
        return self.model.step_count

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records of the membership (pass this object in ``save_checkpoint``'s ``extra``).

        Returns:
            This worker's uid, the epoch, its members (uids in rank order: the member at index r writes the
                checkpoint file ``rank<r>.pt``) and the changes so far.
        """
        return {"uid": self.membership.uid, "epoch": self.membership.epoch, "members": list(self.members),
                "events": [dict(event) for event in self.events]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep what a checkpoint recorded of the membership, as :attr:`restored` (a restarted job reads it).

        Args:
            state: what :meth:`state_dict` returned when the checkpoint was saved.
        """
        self.restored = dict(state)

    def consensus_distance(self, sampled: bool = False) -> float | None:
        r"""The consensus distance over the current group, between two steps; None when it cannot be had.

        :math:`\Xi = \sqrt{\frac1m \sum_i \lVert x_i - \bar x \rVert^2}` over the m members of the group this
        worker trains in (:meth:`DecentralizedDataParallel.consensus_distance`, a collective: every member of the group
        calls it at the same step), or its estimate from sampled coordinates
        (:meth:`DecentralizedDataParallel.estimate_consensus_distance`, a small all-reduce). None while this worker
        trains alone before a new group's first step, and when a membership change interrupts the collective or a
        failed peer broke the group (e.g. the exchange posted for the next step failed): the change is then resolved
        by the next :meth:`update` (a failed peer moves the membership to its next epoch here, so that nothing more is
        posted on the broken group). The interrupted collective runs on in the old group's threads until the group's
        timeout; the re-formation does not wait for it (:meth:`ElasticCommunicator.abandon`).

        Args:
            sampled: estimate it from the wrapper's sampled coordinates instead of all of them.

        Returns:
            :math:`\Xi`, the same on every member of the group, or None.
        """
        if self._pending is not None or self._comm is None or self.model.comm is not self._comm:
            return None
        try:
            return self.model.estimate_consensus_distance() if sampled else self.model.consensus_distance()
        except (*CHANGE_SIGNALS, UseAfterCloseError) as error:
            if isinstance(error, UseAfterCloseError) and self._comm.failure is None:
                raise  # refused for another reason than a failed peer (e.g. after close())
            self.membership.request_change()
            return None

    def before_step(self) -> None:
        """At the top of a step: enter the new epoch once this worker reached its first step R."""
        if self._pending is not None and self.model.step_count >= self._pending.first:
            self._enter()

    def join(self) -> None:
        """Join: wait to be taken in, then enter the new group with its donor's parameters and optimizer state.

        For a restarted or new worker whose wrapper was built over a one-rank communicator
        (:func:`gossip.wrapper.elastic.solo_communicator`); it starts at the group's first step.
        """
        started = time.perf_counter()
        decision = self.membership.join()
        self.model.step_count = decision.first
        self._pending = _Change(decision, decision.first, started, decision.first, "joined", dict(decision.left))
        self._enter()

    def finish(self) -> None:
        """At the end of the loop: end in one group with every other member, which no later change interrupts.

        A pending epoch is entered even if its first step is past the run's last. Then the epoch's members meet on the
        store (:meth:`Membership.await_end`, one outcome for all): a change under way first (a death or a join in the
        last steps, which some members notice only after their loop ended) is resolved as during a step and its
        epoch entered, and they meet again there. What follows the loop (evaluating the averaged model, gathering
        results, closing) then runs as collectives of that one group, uninterrupted (a member that dies meanwhile
        fails them with its named error).
        """
        if self._pending is not None:
            self._enter()
        while self._comm is not None and self.model.comm is self._comm:
            if self.membership.await_end(self.timeout):
                self._comm.completing = True
                return
            self._resolve(MembershipChangedError(f"member {self.membership.uid}: a change at the end of the run"))
            self._enter()

    def update(self) -> None:
        """``optimizer.step()`` (mixing and update), resolving a membership change that interrupts it."""
        try:
            while True:
                try:
                    self.optimizer.step()  # the mixing (completed, or in the new group) or a local update, then it
                    break
                except CHANGE_SIGNALS as error:
                    if self._comm is None:
                        raise
                    if self._pending is None:
                        self._resolve(error)
                        if self.model.step_count >= self._pending.first:
                            self._enter()  # this step was never posted and the new group starts with it: mix it there
                    elif self.model.comm is self._comm:  # a completed step's partner failed before its message arrived
                        self._go_solo()
                    else:
                        raise
        finally:
            if self._comm is not None:
                self._comm.completing = False
        self.last_group = self.group
        if self._pending is not None and self.model.step_count < self._pending.first and self.model.comm is self._comm:
            self._go_solo()  # behind the new group's first step: train alone until it

    def _go_solo(self) -> None:
        self.group = (self.membership.uid,)
        rebind(self.model, solo_communicator(self.timeout), schedule_for(self.schedule_name, 1)[0],
               self.make_algorithm(), self._fresh_tracker())  # fmt: skip

    def _fresh_tracker(self) -> Algorithm | None:
        return None if self.make_tracker is None else self.make_tracker()

    def _resolve(self, error: BaseException) -> None:
        started = time.perf_counter()
        old = self.members
        step, posted, exchanges = self.model.step_count, self.membership.posted, self.membership.exchanges
        schedule = self.model.schedule
        decision = self.membership.decide()
        completed = False
        if posted == step:  # completed when every partner posted as many of the step's exchanges as this end
            view = schedule.peers(old.index(self.membership.uid), step)
            partners = {old[p] for p, _ in (*view.in_peers, *view.out_peers)}
            completed = all(u in decision.members and decision.reached(u, step, exchanges) for u in partners)
        if completed:  # the partner applies it: a later change must not make this end drop it (one-ended mixing)
            self._comm.completing = True
        else:
            self._go_solo()  # step `step` is mixed with nobody: its exchange is dropped on both ends
        outcome = "completed" if completed else "skipped"
        self._pending = _Change(decision, max(decision.first, step), started, step, outcome, dict(decision.left))
        logger.debug("member %d: step %d %s after %s", self.membership.uid, step, outcome, type(error).__name__)

    def _next_epoch(self, change: _Change, error: BaseException) -> _Change | None:
        """The group of ``change`` did not form (``error``): decide the next epoch; None when this member waits."""
        self.membership.restart_silence_watch()
        decision = self.membership.decide()
        if isinstance(error, MembershipError) and set(change.decision.members) <= set(decision.members):
            raise error  # the formation failed with every member alive: retrying would fail alike
        logger.debug("member %d: epoch %d not formed (%s); epoch %d decided", self.membership.uid,
                     change.decision.epoch, error, decision.epoch)  # fmt: skip
        change = replace(change, decision=decision, first=max(change.first, decision.first),
                         left={**change.left, **decision.left})  # fmt: skip
        if self.membership.needs_state:
            self.model.step_count = change.first  # a joiner takes its state at the group's first step
        elif self.model.step_count < change.first:
            self._pending = change
            self._go_solo()  # the others went ahead: train alone until their first step
            return None
        return change

    def _form(self, change: _Change) -> tuple[ElasticCommunicator, str, dict[int, int], int]:
        """Form ``change``'s group and hand the joiners their state: the communicator, schedule note, donors, bytes."""
        decision = change.decision
        self.membership.await_group(decision)
        comm = open_epoch(self.membership, decision.epoch, decision.members, self.timeout, self.step_of)
        try:
            schedule, note = schedule_for(self.schedule_name, len(decision.members))
            algorithm = self.make_algorithm()
            check_supported(schedule, algorithm)
            rebind(self.model, comm, schedule, algorithm, self._fresh_tracker())
            old = [rank for rank, uid in enumerate(decision.members) if uid not in decision.joined]
            donors = {
                decision.members.index(uid): choose_donor(schedule, decision.members.index(uid), change.first, old)
                for uid in decision.joined
            }
            moved = hand_over(self.model, self.optimizer, donors, comm.inner) if donors else 0
        except CHANGE_SIGNALS:
            comm.abandon()
            raise
        return comm, note, donors, moved

    def _enter(self) -> None:
        change = self._pending
        if self._comm is not None and not self._comm._closed:
            self._comm.abandon()
        while True:
            try:
                comm, note, donors, moved = self._form(change)
                break
            except (*CHANGE_SIGNALS, MembershipError) as error:
                change = self._next_epoch(change, error)
                if change is None:
                    return
        decision, first, started = change.decision, change.first, change.started
        self._comm = comm
        if self.membership.uid in decision.joined:
            self.membership.received_state()
        self.group = decision.members
        self.membership.open(first)
        self._pending = None
        step, outcome = change.noticed_at, change.outcome
        seconds = time.perf_counter() - started
        exits = [t for t in (self.membership.exit_time(uid) for uid in change.left) if t is not None]
        since_exit = time.time() - min(exits) if exits else None
        left = ", ".join(f"{uid} ({how})" for uid, how in sorted(change.left.items())) or "nobody"
        if donors:
            left += "; joined: " + ", ".join(f"{decision.members[j]} (from {decision.members[d]}, {moved:,} bytes)"
                                             for j, d in donors.items())  # fmt: skip
        since = f"{since_exit:.2f} s" if since_exit is not None else "unknown time"
        logger.info(
            "gossip elastic: member %d: epoch %d: left: %s, noticed at step %d (its exchange %s); members %s resume "
            "at step %d on schedule %s; re-formed %.2f s after the failure was noticed, %s after the exit",
            self.membership.uid, decision.epoch, left, step, outcome, list(decision.members), first, note, seconds,
            since,
        )  # fmt: skip
        self.events.append(
            {
                "epoch": decision.epoch,
                "left": {str(uid): how for uid, how in change.left.items()},
                "joined": {str(decision.members[j]): decision.members[d] for j, d in donors.items()},
                "handover_bytes": moved,
                "noticed_at_step": step,
                "step_outcome": outcome,
                "resume_step": first,
                "members": list(decision.members),
                "schedule": note,
                "reform_seconds": seconds,
                "seconds_since_exit": since_exit,
                "exit_wall_time": min(exits) if exits else None,
            }
        )
