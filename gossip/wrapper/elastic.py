"""Elastic gossip, the wrapper's side: a new member set at a step boundary, and a joiner's state from a neighbour.

When the member set changes (a rank left or died, a rank joined), every member of the new set calls
:func:`rebind` at the same step boundary t with a communicator over the new members, a schedule of the same family
over the new size (:func:`schedule_for`) and a fresh, unbound algorithm. The wrapper keeps its replica x_t, its step
count, its metrics and the optimizer; whatever exchange of step t was in flight on the old communicator is dropped
without being applied (the step's mixing runs again, on the new group), and the algorithm starts with no per-edge
state: the edges of the new schedule start as on step 0, the vanished ones are gone. A joiner builds its wrapper
over a one-rank communicator (:func:`solo_communicator`), rebinds like the others, and receives the parameters and
the optimizer state of one member (:func:`hand_over`, the *donor*: its first peer in the new schedule at t).

With gradient tracking every member restarts its tracker at its own last input at each rebind, so the trackers sum
to the new members' gradients again (:meth:`gossip.wrapper.tracking.GradientTracker.rebind`).

Exact gossip over a doubly stochastic W preserves the members' sum at every step (docs/design.md B.1), so the
members' mean after a departure at t is the mean of the survivors' replicas at t, and after a join it moves by the
joiner's copy only: (m x̄ + x_donor) / (m + 1). The simulator runs these epochs deterministically
(:func:`gossip.wrapper.elastic_sim.simulate_elastic`); the real processes (:mod:`gossip.wrapper.elastic_run`)
agree on the new member set first and then do exactly this.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch

from gossip.algorithms.base import Algorithm
from gossip.backends.base import Communicator
from gossip.backends.simulator import SimulatorCommunicator, _World
from gossip.errors import ElasticUnsupportedError, InvalidArgumentError, ReplicaMismatchError
from gossip.wrapper.momentum import optimizer_kind
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.peer_agreement import PeerAgreement
from topologies import Schedule, registry
from topologies.schedule import ScheduleError

#: Families tried, in order, when the requested one cannot be built for the new number of ranks (e.g. a
#: hypercube needs n = 2^k). A one-peer family falls back to the one-peer Base-2 graph, which exists for every n
#: and averages exactly after one period (:func:`topologies.base_graph`, the default schedule where n is not a
#: power of two, and the hypercube where it is); any other to the ring, the complete graph the last resort.
ONE_PEER_FALLBACKS = ("base_graph",)
FALLBACKS = ("ring", "complete")

#: The sequence number of the hand-over's two exchanges (the size, then the state): far above any step's.
HANDOVER_SEQ = 2**40


def schedule_for(name: str, n: int, **options: object) -> tuple[Schedule, str]:
    """The schedule of family ``name`` over ``n`` ranks, or the first fallback that exists for ``n``.

    Args:
        name: a built-in schedule family (:func:`topologies.registry.names`).
        n: the number of members, >= 1.
        **options: the family's options (ignored by a fallback).

    Returns:
        The schedule and a note: ``name`` itself, or ``"<fallback> (fallback: <name> needs ...)"`` naming why.

    Raises:
        InvalidArgumentError: no family, not even the complete graph, can be built for ``n``.
    """
    try:
        return registry.by_name(name, n, **options), name
    except ScheduleError as error:
        reason = str(error)
    one_peer = name.startswith("one_peer") or name == "random_matchings"
    for fallback in ONE_PEER_FALLBACKS if one_peer else FALLBACKS:
        try:
            return registry.by_name(fallback, n), f"{fallback} (fallback: {name} over {n} ranks: {reason})"
        except ScheduleError:
            continue
    raise InvalidArgumentError(f"elastic: no schedule for {n} members ({name}: {reason})")


def solo_communicator(timeout: float = 60.0) -> Communicator:
    """A communicator of one rank, for a joiner to build its wrapper before it meets the group.

    Args:
        timeout: seconds that bound its waits (it never waits for anyone).

    Returns:
        A one-rank simulator communicator.
    """
    return SimulatorCommunicator(_World(1), 0, 1, timeout)


def rebind(
    model: DecentralizedDataParallel,
    comm: Communicator,
    schedule: Schedule,
    algorithm: Algorithm,
    tracker: Algorithm | None = None,
) -> None:
    """Move ``model`` to a new member set at a step boundary: ``comm``, ``schedule``, a fresh ``algorithm``.

    Every member of the new set calls it at the same step. The exchange in flight on the old communicator, if
    any, is dropped unapplied (the parameters keep x_t); the step's mixing runs on ``comm`` at the next forward.
    A step whose parameters' mixing is already written (an elastic run interrupted in the trackers' exchange, or
    in a momentum-tracking optimizer's sample of the mean gradient) keeps it: what is left of the step runs on
    ``comm``. With gradient tracking every member restarts its tracker at its own last input
    (:meth:`gossip.wrapper.tracking.GradientTracker.rebind`: the departed ranks' shares are gone, and this restores
    the trackers' sum exactly over the new members).

    Args:
        model: the wrapper.
        comm: the communicator over the new members (this rank's rank in it).
        schedule: the schedule over ``comm.size`` ranks (e.g. from :func:`schedule_for`).
        algorithm: a new, unbound algorithm configured like the old one; its per-edge state starts empty.
        tracker: with gradient tracking, a new, unbound algorithm for the trackers, configured like the old one;
            None makes it from the wrapper's ``gradient_tracking`` name (needed when that was an algorithm object).

    Raises:
        ElasticUnsupportedError: the wrapper's trackers were given as an algorithm object and ``tracker`` is None.
        InvalidArgumentError: the schedule does not fit ``comm`` or the algorithm (from ``algorithm.setup``), or
            the trackers (not doubly stochastic, or not symmetric for compressed trackers).
    """
    mixing = None
    if model.tracker is not None:
        if tracker is None and not model.tracker.remakeable:
            raise ElasticUnsupportedError(
                f"elastic: rank {model.comm.rank}: the gradient trackers were given the algorithm object "
                f"{type(model.tracker.mixing).__name__}; pass a fresh one for each member set (rebind's tracker, "
                "ElasticRun's tracker factory) or give gradient_tracking by name ('exact', 'powergossip', 'sign')"
            )
        mixing = tracker if tracker is not None else model.tracker.remake_mixing()
    if not model._step.mixed:
        model._move("discard", "elastic rebind")
        model._exchange = None
        model._state_before_start = None
    algorithm.setup(comm, schedule, model.buckets)
    if model.tracker is not None:
        model.tracker.rebind(algorithm, schedule, mixing)
    if model._mean_gradient is not None:
        model._mean_gradient.rebind(algorithm, schedule)  # a gossiped sample in progress is dropped
    model.comm, model.schedule, model.algorithm = comm, schedule, algorithm
    model._agreement = PeerAgreement(comm, schedule, algorithm.traffic)
    without_schedule_checks(model)
    model._optimizer_agreed = True  # a joiner compares its optimizer with its donor's instead (hand_over)


def without_schedule_checks(model: DecentralizedDataParallel) -> None:
    """Turn off the wrapper's comparisons with its peers for a wrapper whose members change.

    The wrapper compares W(t) of a schedule without period, and the optimizer over its first steps, with each step's
    peers (:class:`gossip.wrapper.peer_agreement.PeerAgreement`): one more exchange in the step, which a membership
    change could interrupt on one end only. Every member builds each epoch's schedule alike from its family and size
    (:func:`schedule_for`), so the W(t) comparison guards nothing there; the check at construction stays, and
    :class:`~gossip.wrapper.elastic_run.ElasticRun` compares the optimizers once, before the first step.

    Args:
        model: the wrapper.
    """
    model._agreement.stop()


def choose_donor(schedule: Schedule, joiner: int, step: int, old: Sequence[int]) -> int:
    """The member that hands its state to ``joiner``: its first earlier-member in-peer at ``step``, else the lowest.

    Args:
        schedule: the new schedule.
        joiner: the joiner's rank in the new group.
        step: the first step of the new group.
        old: the ranks (in the new group) that were members before.

    Returns:
        The donor's rank in the new group.

    Raises:
        InvalidArgumentError: no member was there before (nobody holds a replica).
    """
    if not old:
        raise InvalidArgumentError(f"elastic: rank {joiner} joins a group with no earlier member to copy")
    for peer, _ in schedule.peers(joiner, step).in_peers:
        if peer in old:
            return peer
    return min(old)


def _pack(optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
    if optimizer is None:
        return torch.zeros(0, dtype=torch.uint8)
    buffer = io.BytesIO()
    torch.save({"kind": optimizer_kind(optimizer), "state": optimizer.state_dict()}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpack(optimizer: torch.optim.Optimizer, state: torch.Tensor, rank: int, donor: int) -> None:
    """Load the donor's optimizer state into ``optimizer``, once their kinds agree (the ranks' agreement at the
    first step, which a joiner cannot take part in; :func:`gossip.wrapper.momentum.check_optimizer_agreement`)."""
    packed = torch.load(io.BytesIO(state.cpu().numpy().tobytes()), weights_only=True)
    mine = optimizer_kind(optimizer)
    if packed["kind"] != mine:
        raise ReplicaMismatchError(
            f"elastic: rank {rank} joins with {mine} where its donor rank {donor} has {packed['kind']}: every member "
            "must use the same optimizer"
        )
    optimizer.load_state_dict(packed["state"])


def hand_over(
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer | None,
    donors: dict[int, int],
    comm: Communicator | None = None,
) -> int:
    """Send a joiner the parameters and optimizer state of its donor; every member calls it after :func:`rebind`.

    Two exchanges between each donor and its joiners (the state's size, then the buckets and the state); members
    that are neither do nothing. The joiner's per-edge algorithm state stays empty (it starts fresh).

    Args:
        model: the wrapper, rebound to the new group.
        optimizer: its optimizer (its state travels too), or None.
        donors: joiner's rank -> donor's rank, in the new group (the same on every member).
        comm: the communicator to move the state on; None is the model's.

    Returns:
        The payload bytes this rank sent or received.

    Raises:
        ReplicaMismatchError: on a joiner, its optimizer is not of its donor's kind
            (:func:`gossip.wrapper.momentum.optimizer_kind`).
    """
    comm = model.comm if comm is None else comm
    rank = comm.rank
    mine = [joiner for joiner, donor in donors.items() if donor == rank]
    moved = 0
    if rank in donors:
        size = torch.zeros(1, dtype=torch.int64)
        comm.exchange([], [(donors[rank], size)], seq=HANDOVER_SEQ).wait()
        state = torch.empty(int(size.item()), dtype=torch.uint8, device=comm.device)
        recvs = [(donors[rank], bucket.buffer) for bucket in model.buckets] + [(donors[rank], state)]
        comm.exchange([], recvs, seq=HANDOVER_SEQ + 1).wait()
        if optimizer is not None and state.numel():
            _unpack(optimizer, state, rank, donors[rank])
        moved = sum(bucket.nbytes for bucket in model.buckets) + state.numel()
    elif mine:
        state = _pack(optimizer).to(comm.device)
        size = torch.tensor([state.numel()], dtype=torch.int64)
        comm.exchange([(joiner, size) for joiner in mine], [], seq=HANDOVER_SEQ).wait()
        sends = [(joiner, t) for joiner in mine for t in [b.buffer for b in model.buckets] + [state]]
        comm.exchange(sends, [], seq=HANDOVER_SEQ + 1).wait()
        moved = len(mine) * (sum(bucket.nbytes for bucket in model.buckets) + state.numel())
    return moved
