"""The algorithm interface: what is exchanged each step, and how it is mixed in.

An algorithm is configured by the user (``ExactGossip(gamma=1.0)``, ``PowerGossip(rank=1)``, ``AllReduce()``)
and bound once with :meth:`Algorithm.setup` to a communicator, a schedule and the flat parameter buckets it
mixes. Each step is split in two so that computation runs in between (docs/design.md G, B.1)::

    pending = algorithm.start(step)   # reads x_t, posts the non-blocking exchange of step t's edges
    ...                               # forward and backward at x_t run meanwhile
    algorithm.finish(pending)         # waits, then applies the mixing to the parameters in place

The buckets must not be modified between ``start`` and ``finish``: their memory is sent without a copy.

``start`` and ``finish`` belong to the base class (template methods): ``start`` first does what every step
needs -- it raises for non-finite values a deferred check found (below), and resets the step's account of bytes
and waits -- then calls the algorithm's own :meth:`Algorithm._start_step`; ``finish`` calls its
:meth:`Algorithm._finish_step`. A subclass implements those two and cannot override ``start`` or ``finish``: such
a class is refused when it is created (a TypeError naming it), so no algorithm can forget the bookkeeping.

Non-finite input. What a peer sent is checked in ``finish`` (one ``torch.isfinite(...).all()`` per received
tensor): with ``nonfinite="raise"`` (default) a NaN or Inf raises :class:`gossip.errors.NonFiniteError` naming
this rank, the peer and the step; with ``"drop"`` that peer's contribution is left out of this step (each
algorithm says how) and a :class:`gossip.errors.NonFiniteWarning` names the peer and the step.

Reading the verdict on the host is a device-to-host synchronisation on a GPU: the CPU would stop queuing work
until the GPU drained. So with ``"raise"`` on CUDA parameters (``deferred_nonfinite_check``, set by ``setup``)
the check is deferred by one step: ``finish`` computes per-peer flags on the device and starts their copy into
pinned host memory behind a CUDA event; the next ``start`` (or :meth:`Algorithm.check_deferred`, which
``DecentralizedDataParallel.close`` calls) reads them -- the event has long completed, so nothing waits -- and
raises the same error, naming the step the values arrived in. The values of that step were mixed in already;
the run stops one step later than with the immediate check. ``"drop"`` must decide before mixing, so it reads
the flags at once (one synchronisation per step); on CPU parameters the check is always immediate (no device).
"""

from __future__ import annotations

import abc
import copy
import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any, final

import torch

from gossip.algorithms.buckets import Bucket
from gossip.backends.base import COLLECTIVE, Communicator, PlannedExchange, Traffic
from gossip.backends.comm_thread import Handle
from gossip.errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError, NonFiniteWarning
from topologies import Schedule

#: held while an algorithm object checks that it is free and binds itself to a rank's communicator
_BINDING = threading.Lock()

__all__ = ["COLLECTIVE", "Algorithm", "Traffic", "check_nonfinite_policy"]


NONFINITE_POLICIES = ("raise", "drop")
_SCALARS = (bool, int, float, str, type(None))
#: Attributes of every bound algorithm that are not settings: the binding and the per-step accounting.
_NOT_CONFIG = frozenset({"comm", "schedule", "buckets", "traffic", "wait_seconds", "deferred_nonfinite_check"})
#: The methods :class:`Algorithm` runs itself (template methods), each with the one a subclass implements instead.
TEMPLATE_METHODS = (("start", "_start_step"), ("finish", "_finish_step"))


def check_nonfinite_policy(owner: str, policy: str) -> str:
    """Return ``policy`` if it is one of :data:`NONFINITE_POLICIES`, else raise naming ``owner``.

    Args:
        owner: the algorithm that was given ``policy``, for the message.
        policy: the ``nonfinite`` setting to check.

    Returns:
        ``policy`` itself.

    Raises:
        InvalidArgumentError: ``policy`` is not one of :data:`NONFINITE_POLICIES`.
    """
    if policy not in NONFINITE_POLICIES:
        raise InvalidArgumentError(f"{owner}: nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}")
    return policy


def extremes(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The minimum and maximum of every non-empty floating-point tensor of ``tensors``, stacked (None if none).

    They are finite exactly when the tensors are: a NaN anywhere makes both the minimum and the maximum NaN (as
    documented for ``torch.aminmax``), an Inf is itself the minimum or the maximum. One ``aminmax`` reads each
    tensor once and writes two numbers, where ``isfinite(t).all()`` first writes a bool tensor as large as ``t``.

    Args:
        tensors: the tensors to inspect; empty and non-floating ones are skipped.

    Returns:
        A 1-dim tensor of two numbers per inspected tensor, or None when no tensor was inspected.
    """
    checked = [t for t in tensors if t.numel() and t.is_floating_point()]
    return torch.stack([value for t in checked for value in torch.aminmax(t)]) if checked else None


def all_finite_on_host(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no element of ``tensors`` is NaN or +-Inf, read on the host (see :func:`extremes`).

    On the CPU each extreme is read as it is (a read there is a load, not a sync), which is cheaper than stacking
    them first; on another device the extremes are stacked and read back in one transfer.

    Args:
        tensors: the tensors to check; empty and non-floating ones count as finite.

    Returns:
        True when every element is finite.
    """
    checked = [t for t in tensors if t.numel() and t.is_floating_point()]
    if checked and checked[0].device.type == "cpu":
        return all(math.isfinite(value) for t in checked for value in torch.aminmax(t))
    values = extremes(checked)
    return values is None or all(map(math.isfinite, values.tolist()))


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether no element of ``tensors`` is NaN or +-Inf, read on the device, without a host sync.

    Empty and non-floating tensors count as finite; see :func:`extremes`.

    Args:
        tensors: the tensors to check, on one device.

    Returns:
        A 0-dim bool tensor on the tensors' device.
    """
    values = extremes(tensors)
    if values is None:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.isfinite(values).all()


class Algorithm(abc.ABC):
    """Base class: holds the binding (communicator, schedule, buckets) and the accounting of one step.

    The account: bytes per peer (``traffic``) and seconds blocked waiting for the exchange (``wait_seconds``,
    exposed communication). It is kept here, once: an algorithm communicates through :meth:`_exchange` and
    :meth:`_all_reduce`, which hand ``traffic`` to the communicator, and so count what the communicator was given to
    move; and it waits through :meth:`_wait`, which adds the time blocked. A part that a composite binds with
    :meth:`setup_part` books into the composite's account (the same ``traffic``; its waits add to the composite's
    ``wait_seconds``), so a composite's step reports everything its parts moved without copying their numbers.

    A step is :meth:`start` then :meth:`finish`, which the base class runs (template methods) and no subclass may
    override (refused at class creation): ``start`` does the step's common bookkeeping and then calls the
    subclass's :meth:`_start_step`; ``finish`` calls its :meth:`_finish_step`.
    """

    name: str = "algorithm"
    needs_symmetric_schedule: bool = False
    #: What NaN or Inf received from a peer does: "raise" or "drop" (module docstring); fixed for algorithms that
    #: have no choice (All-Reduce), a constructor argument of those that do.
    nonfinite: str = "raise"
    #: True when ``start`` never changes what :meth:`state_dict` returns (only ``finish`` does): the wrapper then
    #: reads the state when a checkpoint asks for it, instead of copying it before every ``start`` (DiLoCo's state
    #: is two copies of the model).
    start_keeps_state: bool = False
    #: True when :meth:`state_dict` returns a snapshot -- new containers and copies of every tensor, which later
    #: steps never change -- so that :meth:`state_snapshot` can keep it as returned. The default, False, is right
    #: for an algorithm that does not say so: its state is deep-copied (``__init_subclass__`` resets it for a
    #: subclass that writes its own ``state_dict`` and does not set it).
    state_dict_is_snapshot: bool = False

    comm: Communicator
    schedule: Schedule | None
    buckets: list[Bucket]
    #: Set while a composite binds this algorithm to one level of its own schedule (see :meth:`setup_part`).
    _part_of: Algorithm | None = None
    #: The algorithm whose step account this one books into: itself, or the composite that bound it as a part.
    _account: Algorithm | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a subclass that overrides :meth:`start` or :meth:`finish`: the base class runs them, so that
        every algorithm gets the step's bookkeeping; the subclass implements :meth:`_start_step` and
        :meth:`_finish_step`. A subclass that writes its own :meth:`state_dict` without saying whether it returns a
        snapshot (``state_dict_is_snapshot`` in its class body) does not inherit its parent's answer: its state is
        deep-copied."""
        super().__init_subclass__(**kwargs)
        if "state_dict" in vars(cls) and "state_dict_is_snapshot" not in vars(cls):
            cls.state_dict_is_snapshot = False
        for method, hook in TEMPLATE_METHODS:
            if method in vars(cls):
                raise ArgumentTypeError(
                    f"{cls.__module__}.{cls.__qualname__} overrides Algorithm.{method}(), which the base class runs "
                    f"itself (it does every step's bookkeeping: the deferred non-finite check and the reset of the "
                    f"step's account of bytes and waits); implement {hook}() instead, which {method}() calls"
                )

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        """Bind to ``comm``, ``schedule`` and ``buckets``; refuse a schedule this algorithm cannot run.

        Args:
            comm: this rank's communicator.
            schedule: the gossip schedule, or None for an algorithm that needs none.
            buckets: the parameter buckets to mix in place.

        Raises:
            InvalidArgumentError: this object is already bound to another rank (create one per rank), or the
                schedule does not fit the communicator or this algorithm.
        """
        with _BINDING:  # the check and the claim at once: the simulator's ranks are threads of one process
            bound = getattr(self, "comm", None)
            if bound is not None and bound is not comm:
                raise InvalidArgumentError(
                    f"this {type(self).__name__} is already bound to rank {bound.rank}; create one algorithm object "
                    f"per rank (rank {comm.rank} tried to reuse it)"
                )
            self.comm = comm
        try:
            if schedule is not None:
                schedule.require_size(comm.size)
                if self._part_of is None:
                    # Also for a schedule built with validate=False: negative weights, rows not summing to one or a
                    # disconnected graph are refused here, naming the step, the ranks and the property.
                    schedule.validate(symmetric=self.needs_symmetric_schedule)
        except BaseException:
            if bound is None:
                del self.comm  # a refused setup binds nothing
            raise
        self.schedule, self.buckets = schedule, buckets
        owner = self._part_of
        self._account = self if owner is None else owner._account
        self.traffic = Traffic() if owner is None else owner.traffic
        self.wait_seconds = 0.0
        self.deferred_nonfinite_check = any(bucket.buffer.is_cuda for bucket in buckets)
        self._unchecked: list[tuple[int, list[int], torch.Tensor, Any]] = []  # step, peers, flags, CUDA event

    def setup_part(self, part: Algorithm, level: Schedule, buckets: list[Bucket]) -> None:
        """Bind ``part``, an algorithm this composite runs on one level of its own schedule, to ``level``.

        Call it from the composite's :meth:`setup` after ``super().setup``: the composite's schedule has been
        validated as a whole, and ``level`` is the part of it that ``part`` runs, which need not be a valid
        schedule on its own (e.g. the inter-node pairs of hierarchical gossip, disconnected on purpose). So
        ``level`` is checked for its size only; ``part`` binds to this composite's communicator, and books its
        bytes and waits into this composite's step account.

        Args:
            part: the algorithm to bind.
            level: the schedule ``part`` runs.
            buckets: the buckets ``part`` mixes.
        """
        part._part_of = self
        try:
            part.setup(self.comm, level, buckets)
        finally:
            part._part_of = None

    def _exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], seq: int
    ) -> Handle:
        """:meth:`Communicator.exchange`, its payload bytes booked to this step's ``traffic`` per peer."""
        return self.comm.exchange(sends, recvs, seq=seq, traffic=self.traffic)

    def _start_planned(self, plan: PlannedExchange, seq: int) -> Handle:
        """:meth:`Communicator.start_planned`, booked to this step's ``traffic`` as :meth:`_exchange` books."""
        return self.comm.start_planned(plan, seq=seq, traffic=self.traffic)

    def _all_reduce(self, tensor: torch.Tensor, op: str = "avg", in_step: bool = False) -> Handle:
        """A non-blocking :meth:`Communicator.all_reduce`, booked to ``traffic`` as a ring all-reduce."""
        return self.comm.all_reduce(tensor, op, async_op=True, traffic=self.traffic, in_step=in_step)

    def check_deferred(self) -> None:
        """Raise :class:`NonFiniteError` if a deferred check found non-finite values from a peer.

        See the module docstring; a no-op when nothing is pending. Waits only for the flags' copy, done long before.

        Raises:
            NonFiniteError: a peer sent NaN or Inf in an earlier step; the message names the peer and the step.
        """
        pending, self._unchecked = getattr(self, "_unchecked", []), []
        for step, peers, flags, event in pending:
            if event is not None:
                event.synchronize()
            finite = flags.tolist()
            if not all(finite):
                bad = peers[finite.index(False)]
                raise NonFiniteError(
                    f"rank {self.comm.rank}: step {step}: peer {bad} sent non-finite values (NaN or Inf) to mix in; "
                    f"its replica has diverged (found one step later: on a GPU the check is read without a host "
                    f"sync, and the values were mixed in). {self._nonfinite_remedy()}{self._nonfinite_hint()}"
                )

    def _defer_nonfinite_check(self, step: int, received: list[tuple[int, list[torch.Tensor]]]) -> None:
        """Per-peer finite flags on the device, copied to pinned host memory without waiting (read later)."""
        checked = [(peer, [t for t in tensors if t.numel()]) for peer, tensors in received]
        checked = [(peer, tensors) for peer, tensors in checked if tensors]
        if not checked:
            return
        peers = [peer for peer, _ in checked]
        flags = torch.stack([all_finite(tensors) for _, tensors in checked])
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flags = host
        self._unchecked.append((step, peers, flags, event))

    def _wait(self, handle: Handle) -> None:
        """Wait for ``handle``, adding the time blocked to ``wait_seconds`` (the step's exposed communication)."""
        before = handle.wait_seconds
        handle.wait()
        account = self._account if self._account is not None else self
        account.wait_seconds += handle.wait_seconds - before

    def _nonfinite_remedy(self) -> str:
        """The non-finite error's advice: what this algorithm offers instead of raising (default: ``"drop"``)."""
        return f"{type(self).__name__}(nonfinite='drop') leaves such a contribution out instead"

    def _nonfinite_hint(self) -> str:
        """Appended to the non-finite error: another cause this algorithm knows of (default: none)."""
        return ""

    def _nonfinite_peers(self, step: int, policy: str, received: list[tuple[int, list[torch.Tensor]]]) -> set[int]:
        """The peers among ``(peer, tensors it sent)`` whose tensors hold NaN or Inf, under ``policy``.

        ``"raise"``: raise :class:`NonFiniteError` for the first such peer -- or, with
        ``deferred_nonfinite_check``, at the next step (see the module docstring) and return no peer now.
        ``"drop"``: warn once per peer and return them, for the caller to leave out.
        """
        if policy == "raise" and self.deferred_nonfinite_check:
            self._defer_nonfinite_check(step, received)
            return set()
        if all_finite_on_host([t for _, tensors in received for t in tensors]):
            return set()
        return self._refuse_nonfinite(
            step, policy, [peer for peer, tensors in received if not bool(all_finite(tensors))]
        )

    def _refuse_nonfinite(self, step: int, policy: str, bad: list[int]) -> set[int]:
        """What :meth:`_nonfinite_peers` does with the peers ``bad`` found to have sent NaN or Inf, for an algorithm
        that finds them itself (from values it reads anyway): ``"raise"`` raises :class:`NonFiniteError` for the
        first, ``"drop"`` warns once per peer and returns them."""
        if not bad:
            return set()
        me = self.comm.rank
        if policy == "raise":
            raise NonFiniteError(
                f"rank {me}: step {step}: peer {bad[0]} sent non-finite values (NaN or Inf) to mix in; its replica "
                f"has diverged. {self._nonfinite_remedy()}{self._nonfinite_hint()}"
            )
        for peer in bad:
            warnings.warn(
                f"rank {me}: step {step}: dropped the contribution of peer {peer}, which sent non-finite values "
                "(NaN or Inf); its weight stays with this rank's own parameters",
                NonFiniteWarning,
                stacklevel=3,
            )
        return set(bad)

    @final
    def start(self, step: int) -> Any:
        """Begin step ``step``.

        Raises for non-finite values a deferred check found (:meth:`check_deferred`), resets the step's account
        (``traffic``, ``wait_seconds``; a part leaves it alone, its composite reset it when its own step began), then
        posts the exchange (:meth:`_start_step`).

        Args:
            step: the step's number, the same on every rank.

        Returns:
            What :meth:`finish` needs, to pass it unchanged.
        """
        self.check_deferred()
        if self._account is self:
            self.traffic.new_step()
            self.wait_seconds = 0.0
        return self._start_step(step)

    @final
    def finish(self, pending: Any) -> None:
        """Complete the exchange ``start`` returned as ``pending``; mix into the buckets (:meth:`_finish_step`).

        Args:
            pending: what :meth:`start` returned.
        """
        self._finish_step(pending)

    @abc.abstractmethod
    def _start_step(self, step: int) -> Any:
        """The algorithm's part of :meth:`start`, after the bookkeeping: read the buckets, post step ``step``'s
        exchange (:meth:`_exchange`, :meth:`_start_planned` or :meth:`_all_reduce`) and return what
        :meth:`_finish_step` needs. Must not write the buckets."""

    @abc.abstractmethod
    def _finish_step(self, pending: Any) -> None:
        """The algorithm's part of :meth:`finish`: wait (:meth:`_wait`), check what peers sent
        (:meth:`_nonfinite_peers`) and mix into the buckets in place."""

    def progress(self, pending: Any, wait: bool = False) -> bool:
        """Make progress on the open step's communication, between ``start`` and ``finish``.

        :class:`gossip.DecentralizedDataParallel` calls it from its backward hooks (the parameters are not written
        between ``start`` and ``finish``, so whatever depends only on x_t may run there), until it returns False.
        It must leave ``finish``'s result bit for bit what it would be without it. Without ``wait`` it never
        waits; with ``wait`` it posts every exchange of the step that it could post early, waiting for those they
        need: the wrapper does so before a collective inside the step, so that every rank's communicator holds the
        same operations in the same order (a communicator runs them in order, and a collective queued behind an
        exchange whose peer posts it only in ``finish`` would never start). Default: nothing to do.
        :meth:`gossip.algorithms.powergossip.PowerGossip.progress` runs its further power iterations there.

        Args:
            pending: what :meth:`start` returned for the open step.
            wait: post everything that may be posted early, waiting as needed.

        Returns:
            Whether a later call may still make progress this step.
        """
        return False

    def drain(self) -> None:
        """Complete communication still in flight from an earlier step and drop its result (default: none).

        For an algorithm whose exchange outlives its step (:class:`gossip.algorithms.outer.OuterOptimizer` with a
        delay); :meth:`gossip.DecentralizedDataParallel.close` calls it on every rank, so no peer is left waiting.
        """
        return

    def step(self, step: int) -> None:
        """``start`` and ``finish`` back to back (no overlap): for consensus experiments and tests.

        Args:
            step: the step's number, the same on every rank.
        """
        self.finish(self.start(step))

    def config(self) -> dict[str, Any]:
        """The hyper-parameters every rank must share (compared at construction and stored in checkpoints).

        Default: the public scalar attributes (``gamma``, ``every``, ...), without the binding (``comm``,
        ``schedule``, ``buckets``, and ``deferred_nonfinite_check``, which follows the parameters' device) and the
        per-step accounting (``traffic``, ``wait_seconds``), so it is the same before and after :meth:`setup`.
        Override it when a setting is not a public scalar.

        Returns:
            Setting name -> value.
        """
        return {
            key: value
            for key, value in vars(self).items()
            if not key.startswith("_") and isinstance(value, _SCALARS) and key not in _NOT_CONFIG
        }

    def describe(self) -> dict[str, Any]:
        """How this rank's instance treats the parameters it is bound to; default: every tensor travels exactly.

        Returns:
            A summary for logs (e.g. which tensors are compressed).
        """
        return {"exact": [entry.name for bucket in getattr(self, "buckets", []) for entry in bucket.entries]}

    def in_flight_state(self) -> dict[str, Any]:
        """What a checkpoint needs of the exchange kept in flight across steps, waiting for it to complete.

        Waiting changes nothing the training computes (the result is applied when it would have been anyway). An
        algorithm that applies an exchange at a later step than it posts it
        (``PowerGossip(delayed_last_iteration=True)``) overrides it, :meth:`load_in_flight_state` and :meth:`drain`.

        Returns:
            The state, for :meth:`load_in_flight_state`; empty when nothing is in flight (the default).
        """
        return {}

    def load_in_flight_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`in_flight_state` (after :meth:`load_state_dict`); its result is applied as it would have been.

        Args:
            state: what :meth:`in_flight_state` returned.

        Raises:
            InvalidArgumentError: ``state`` is not empty, for an algorithm that keeps nothing in flight.
        """
        if state:
            raise InvalidArgumentError(f"{self.name} keeps no exchange in flight across steps, but one was given")

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint (empty for stateless algorithms).

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        return {}

    def state_snapshot(self) -> dict[str, Any]:
        """:meth:`state_dict` as a value that later steps cannot change.

        As returned where it already is one (``state_dict_is_snapshot``), deep-copied otherwise. The wrapper and the
        composites keep it from before each ``start``: a checkpoint taken while that step's exchange is in flight
        holds it.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        state = self.state_dict()
        return state if self.state_dict_is_snapshot else copy.deepcopy(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned; a stateless algorithm accepts only an empty one.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: ``state`` is not empty, for an algorithm that keeps none.
        """
        if state:
            raise InvalidArgumentError(f"{self.name} keeps no state, but a non-empty state was given: {sorted(state)}")
