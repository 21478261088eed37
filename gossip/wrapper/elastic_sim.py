"""Membership changes on the simulator: ranks leave at step t, join at step s, deterministically.

:func:`simulate_elastic` runs a training of ``steps`` steps as a sequence of *epochs*, one per member set. Each
epoch is one :func:`gossip.backends.simulator.simulate` call over the epoch's members (a fresh communicator, as a
real run gets a fresh Gloo group per epoch); each member's wrapper, optimizer and anything else it keeps live in a
:class:`Member` that outlives the epochs. At a boundary t the members of the next epoch call
:func:`gossip.wrapper.elastic.rebind` with a schedule of the same family over the new size
(:func:`~gossip.wrapper.elastic.schedule_for`) and a fresh algorithm; joiners are built over a one-rank
communicator and receive their donor's parameters and optimizer state (:func:`~gossip.wrapper.elastic.hand_over`).
A rank that leaves at t takes no part in step t: its last step is t - 1. Nothing depends on thread timing.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gossip.algorithms.base import Algorithm
from gossip.backends.base import Communicator
from gossip.backends.simulator import simulate
from gossip.errors import InvalidArgumentError
from gossip.wrapper.elastic import choose_donor, hand_over, rebind, schedule_for, solo_communicator
from gossip.wrapper.parallel import DecentralizedDataParallel
from topologies import Schedule


@dataclass(frozen=True)
class Change:
    """A membership change: ``uid`` leaves (``join=False``) or joins (``join=True``) before step ``step``.

    Attributes:
        step: the first step the new member set runs.
        uid: the member's identity (its rank at the start, or a new number for a new member).
        join: True for a join, False for a departure.
    """

    step: int
    uid: int
    join: bool = False


@dataclass
class Member:
    """What one member keeps across epochs.

    Attributes:
        uid: its identity.
        model: its wrapper.
        optimizer: its optimizer, or None.
        extra: anything else the caller's functions keep (data iterators, losses).
    """

    uid: int
    model: DecentralizedDataParallel
    optimizer: torch.optim.Optimizer | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Epoch:
    """One member set: its members (uids in rank order), its steps and its schedule.

    Attributes:
        members: the uids, rank order.
        start: its first step.
        stop: the step after its last.
        schedule: what schedule_for said (the family, or the fallback and why).
        joined: uids that joined at ``start``, with their donor's uid.
    """

    members: tuple[int, ...]
    start: int
    stop: int
    schedule: str
    joined: dict[int, int]


def _run_epoch(
    comm: Communicator, *, uids: tuple[int, ...], steps: range, first: bool, members: dict[int, Member],
    build: Callable[..., Member], train_step: Callable[[Member, int], None], schedule: Schedule,
    algorithm: Callable[[], Algorithm], donors: dict[int, int],
) -> None:  # fmt: skip
    """One member's epoch: built (first epoch) or rebound and handed over, then ``steps`` training steps."""
    uid = uids[comm.rank]
    if first:
        members[uid] = build(comm, schedule, algorithm(), uid)
    else:
        member = members[uid]
        rebind(member.model, comm, schedule, algorithm())
        hand_over(member.model, member.optimizer, donors)
    for step in steps:
        train_step(members[uid], step)


def plan_epochs(size: int, steps: int, changes: Sequence[Change]) -> list[tuple[tuple[int, ...], int, int]]:
    """The member sets of a run: ``(members, start, stop)`` per epoch, members sorted by uid.

    Args:
        size: the members at step 0 (uids ``0 .. size - 1``).
        steps: the run's length.
        changes: the membership changes, any order.

    Returns:
        The epochs in order.

    Raises:
        InvalidArgumentError: a change leaves a uid that is not a member, joins one that is, falls outside
            ``(0, steps)``, or leaves nobody.
    """
    for change in changes:
        if not 0 < change.step < steps:
            raise InvalidArgumentError(f"elastic: change {change} is not inside the run's steps (0, {steps})")
    members = set(range(size))
    bounds = sorted({c.step for c in changes} | {0, steps})
    epochs = []
    for start, stop in itertools.pairwise(bounds):
        for change in sorted((c for c in changes if c.step == start), key=lambda c: (c.join, c.uid)):
            if change.join == (change.uid in members):
                state = "already a member" if change.join else "not a member"
                raise InvalidArgumentError(f"elastic: change {change}: uid {change.uid} is {state} at step {start}")
            (members.add if change.join else members.discard)(change.uid)
        if not members:
            raise InvalidArgumentError(f"elastic: no member is left at step {start}")
        epochs.append((tuple(sorted(members)), start, stop))
    return epochs


def simulate_elastic(
    size: int,
    steps: int,
    changes: Sequence[Change],
    *,
    build: Callable[[Communicator, Schedule, Algorithm, int], Member],
    train_step: Callable[[Member, int], None],
    schedule: str,
    algorithm: Callable[[], Algorithm],
    between: Callable[[int, dict[int, Member]], None] | None = None,
    timeout: float = 60.0,
) -> tuple[dict[int, Member], list[Epoch]]:
    """Train ``steps`` steps on the simulator while members leave and join as ``changes`` say.

    Args:
        size: the members at step 0.
        steps: the number of steps.
        changes: the departures and joins.
        build: ``build(comm, schedule, algorithm, uid)`` wraps a new member's model (a collective over ``comm``:
            all initial members at step 0; a joiner alone, over a one-rank communicator).
        train_step: ``train_step(member, step)`` runs one training step of one member.
        schedule: the schedule family (a fallback is used where it cannot be built, and the epoch says so).
        algorithm: makes one fresh, unbound algorithm.
        between: called as ``between(next_start, members)`` at each boundary, before the change (for snapshots).
        timeout: the simulator's wait bound.

    Returns:
        Every member that ever existed (uid -> :class:`Member`; departed ones as they left) and the epochs run.
    """
    members: dict[int, Member] = {}
    epochs: list[Epoch] = []
    for index, (uids, start, stop) in enumerate(plan_epochs(size, steps, changes)):
        new_schedule, note = schedule_for(schedule, len(uids))
        joiners = [uid for uid in uids if uid not in members or "left" in members[uid].extra] if index else []
        if index:
            if between is not None:
                between(start, {uid: m for uid, m in members.items() if "left" not in m.extra})
            for uid, member in members.items():
                if uid not in uids and "left" not in member.extra:
                    member.extra["left"] = start
            for uid in joiners:
                solo, solo_schedule = solo_communicator(timeout), schedule_for(schedule, 1)[0]
                members[uid] = build(solo, solo_schedule, algorithm(), uid)
                members[uid].model.step_count = start
        old = [rank for rank, uid in enumerate(uids) if uid not in joiners] if index else []
        donors = {uids.index(j): choose_donor(new_schedule, uids.index(j), start, old) for j in joiners}
        epochs.append(Epoch(uids, start, stop, note, {uids[j]: uids[d] for j, d in donors.items()}))
        run = functools.partial(
            _run_epoch, uids=uids, steps=range(start, stop), first=index == 0, members=members, build=build,
            train_step=train_step, schedule=new_schedule, algorithm=algorithm, donors=donors,
        )  # fmt: skip
        simulate(len(uids), run, timeout=timeout)
    return members, epochs
