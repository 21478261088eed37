"""The communicator of one membership epoch: a Gloo group over the epoch's members, whose waits a change interrupts.

:func:`open_epoch` creates the epoch's Gloo default group on the store prefix ``elastic/<epoch>/`` (the previous
epoch's group must have been abandoned first: :meth:`ElasticCommunicator.abandon`). :class:`ElasticCommunicator`
delegates every operation to a :class:`~gossip.backends.torch_dist.TorchDistCommunicator` on it, with two changes:

* an exchange is posted only while :meth:`Membership.try_post` allows it (no change under way) and the group is not
  broken by a failed peer; otherwise its handle raises :class:`MembershipChangedError` when waited for, and nothing
  was sent. The same holds for an exchange that the group's thread refuses because an operation queued before it
  failed meanwhile (:class:`~gossip.errors.UseAfterCloseError` quoting that failure): the failure is a change to
  resolve, not a misuse. An all-reduce that is part of a step's update (``all_reduce(..., in_step=True)``: momentum
  tracking's sample of the mean gradient) is posted and refused the same way, and counts among the step's
  exchanges in the member's check-in;
* a wait returns, or raises :class:`MembershipChangedError` as soon as a change is under way (the transfers stay
  posted: waiting on the handle again after the decision completes them when the peer posted them too). While
  :attr:`ElasticCommunicator.completing` is set (a step the decision resolved as completed is waited for again) a
  further change does not interrupt the wait: the partner applies the step, so this end must too; the wait ends
  with the transfers, or with the partner's failure or the timeout. It is set as well once every member reached
  the end of the run together (:meth:`ElasticRun.finish`): what follows (an evaluation, gathering results) is
  collectives of that group, which a later change (a join asked too late) must not interrupt on some members only.

A collective (all-reduce, all-gather) is refused with :class:`MembershipChangedError` while a change is under way.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from gossip.backends.base import Communicator
from gossip.backends.comm_thread import Handle
from gossip.backends.launch_env import LaunchInfo
from gossip.backends.membership import Membership
from gossip.backends.torch_dist import TorchDistCommunicator
from gossip.backends.wire import Transfer
from gossip.errors import MembershipChangedError, MembershipError, UseAfterCloseError

#: Seconds between two looks at the membership while a wait is blocked.
POLL = 0.02
#: Abandoned groups, each with the time by which its operations in flight have ended (their timeout): kept
#: referenced until then, since destroying the last reference to a Gloo group joins its threads, which wait in an
#: operation that a change interrupted (a peer that never posts it) until the timeout
_ABANDONED: list[tuple[float, Any]] = []


class _NotPosted(Handle):
    def __init__(self, rank: int, operation: str):
        self._rank, self._operation = rank, operation

    def done(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> None:
        raise MembershipChangedError(f"rank {self._rank}: {self._operation} not posted: the membership is changing")


class _Interruptible(Handle):
    def __init__(self, inner: Any, comm: ElasticCommunicator):
        self._inner, self._comm = inner, comm

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> None:
        start = time.perf_counter()
        future = getattr(self._inner, "_future", None)
        try:
            while future is not None and not future.done():
                if self._comm.membership.changed.is_set() and not self._comm.completing:
                    raise MembershipChangedError(
                        f"rank {self._comm.rank}: a wait was interrupted: the membership is changing"
                    )
                concurrent.futures.wait([future], timeout=POLL)
            self._inner.wait(timeout)
        finally:
            self.wait_seconds += time.perf_counter() - start


class _InterruptibleExchange(_Interruptible):
    """A step's exchange's handle: a refusal by the group's thread after an earlier failure asks for the change."""

    def __init__(self, inner: Any, comm: ElasticCommunicator, operation: str):
        super().__init__(inner, comm)
        self._operation = operation

    def wait(self, timeout: float | None = None) -> None:
        try:
            super().wait(timeout)
        except UseAfterCloseError as refusal:
            failure = self._comm.failure
            if failure is None:
                raise  # refused for another reason than a failed operation (e.g. after close())
            raise MembershipChangedError(
                f"rank {self._comm.rank}: {self._operation} was not run: the group is broken by an earlier failure: "
                f"{failure}"
            ) from refusal


class ElasticCommunicator(Communicator):
    """One epoch's Gloo communicator, interrupted by a membership change (see the module docstring).

    Args:
        inner: the Gloo communicator on the epoch's group.
        membership: this worker's membership.
        step_of: returns the training step being posted (the wrapper's ``step_count``).
    """

    def __init__(self, inner: TorchDistCommunicator, membership: Membership, step_of: Any):
        super().__init__()
        self.inner, self.membership, self._step_of = inner, membership, step_of
        self.backend, self.rank, self.size = inner.backend, inner.rank, inner.size
        self.local_rank, self.local_size = inner.local_rank, inner.local_size
        self.device, self.timeout = inner.device, inner.timeout
        #: set while the members finish together what all agreed on (a step resolved as completed, waited for again;
        #: the work after the run's end): no change interrupts it (module doc)
        self.completing = False
        self._closed = False

    @property
    def failure(self) -> BaseException | None:
        """The inner communicator's first error (None while healthy)."""
        return self.inner.failure

    def _refuse_during_change(self, operation: str) -> None:
        if self.membership.changed.is_set() and not self.completing:
            raise MembershipChangedError(f"rank {self.rank}: {operation} refused: the membership is changing")

    def _post_in_step(self, operation: str, start: Callable[[], Handle]) -> Handle:
        # a group broken by a failed peer (e.g. in a collective) posts nothing more: its wait asks for the change,
        # before the step's update, as an exchange that fails does; what is posted is counted (Membership.try_post)
        if self.inner.failure is not None or not self.membership.try_post(self._step_of()):
            return _NotPosted(self.rank, operation)
        return _InterruptibleExchange(start(), self, operation)

    def _start_exchange(self, sends: list[Transfer], recvs: list[Transfer], seq: int) -> Handle:
        return self._post_in_step(f"exchange {seq}", lambda: self.inner._start_exchange(sends, recvs, seq))

    def _start_step_all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        return self._post_in_step(
            f"the all-reduce of step {self._step_of()}", lambda: self.inner._all_reduce(tensor, op)
        )

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        self._refuse_during_change("all_reduce")
        return _Interruptible(self.inner._all_reduce(tensor, op), self)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        self._refuse_during_change("broadcast")
        return _Interruptible(self.inner._broadcast(tensor, src), self)

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every member of the epoch arrives (see :meth:`Communicator.barrier`).

        Args:
            timeout: seconds to wait at most; None waits the communicator's timeout.
        """
        self._refuse_during_change("barrier")
        self.inner.barrier(timeout)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, in rank order (see :meth:`Communicator.all_gather_object`).

        Args:
            obj: a picklable object.

        Returns:
            One object per member of the epoch.
        """
        self._refuse_during_change("all_gather_object")
        return self.inner.all_gather_object(obj)

    def abandon(self) -> None:
        """Leave the epoch's group without a barrier (members are gone): stop its thread, destroy the group.

        Returns at once, also with an operation still in flight that a peer will never complete (a collective that a
        change interrupted): the group object stays referenced until that operation's timeout has passed, so that
        its threads are not joined here.
        """
        self._closed = self.inner._closed = True
        self.inner._thread.stop(timeout=0.0)
        now = time.monotonic()
        _ABANDONED[:] = [(ends, group) for ends, group in _ABANDONED if ends > now]  # theirs have timed out
        if dist.is_initialized():
            _ABANDONED.append((now + self.timeout + 1.0, dist.group.WORLD))  # released at a later abandon
            dist.destroy_process_group()

    def close(self) -> None:
        """Close the epoch's group as a communicator closes (barrier when healthy); safe to call twice."""
        if not self._closed:
            self._closed = True
            self.inner.close()


def open_epoch(
    membership: Membership, epoch: int, members: tuple[int, ...], timeout: float, step_of: Any
) -> ElasticCommunicator:
    """Create epoch ``epoch``'s Gloo group over ``members`` and its communicator (a collective of the members).

    Args:
        membership: this worker's membership (its store hosts the group's rendezvous).
        epoch: the epoch.
        members: the uids in rank order.
        timeout: seconds that bound every wait of the group (and its creation).
        step_of: returns the training step being posted.

    Returns:
        The communicator; this worker's rank is its index in ``members``.

    Raises:
        MembershipError: the group could not be formed (a member died during the re-formation).
    """
    rank = members.index(membership.uid)
    info = LaunchInfo(rank=rank, size=len(members), local_rank=rank, local_size=len(members), launcher="none")
    try:
        # a client of its own: the group's rendezvous waits on it, which must not hold up the heartbeats
        client = TCPStore(membership.store.host, membership.store.port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
        inner = TorchDistCommunicator("gloo", info, None, timeout, store=dist.PrefixStore(f"elastic/{epoch}/", client))
    except Exception as error:  # c10d raises DistStoreError / RuntimeError when a member never arrives
        if dist.is_initialized():
            dist.destroy_process_group()
        raise MembershipError(
            f"member {membership.uid}: epoch {epoch}'s group over {list(members)} could not be formed within "
            f"{timeout:.0f} s ({str(error).splitlines()[0]}): a member failed during the re-formation"
        ) from error
    return ElasticCommunicator(inner, membership, step_of)
