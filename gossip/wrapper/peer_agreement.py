r"""What the ranks must agree on during training, compared with each step's peers: point to point, no collective.

Construction compares everything it can see once, over every rank (:func:`gossip.wrapper.replicas.check_replicas`).
Two things can only be compared later:

* the optimizer, created after wrapping: with gradient tracking or a momentum-tracking optimizer, ranks that step on
  different kinds (:func:`gossip.wrapper.momentum.optimizer_kind`) would mix quantities of different meaning, or one
  would sample the mean gradient while a peer does not;
* a schedule without period, whose W(t) construction compared over its first ``window`` steps only: ranks that
  built it differently (another seed) usually disagree about the edges, which stops the exchange, but can also
  agree on the edges and differ in the weights, which would mix silently wrong.

At step t this rank sends a small message (:data:`MESSAGE_BYTES` bytes: SHA-256 digests of W(t) and of the
optimizer's kind, and the kind's text for the error) to W(t)'s out-peers and receives one from each in-peer, posted
right after the parameters' exchange and checked at the optimizer step. Why comparing with peers is enough:

* W(t): if every pair of peers at step t holds the same W(t), every connected component of step t's graph does,
  and a component's mixing uses only its own block of W(t); so step t mixes as W(t) says. Compared at every step
  past the construction's window.
* the optimizer: compared at each of the ``len(schedule.check_steps)`` steps after the first optimizer step (one
  period, or the window), whose union graph validation found strongly connected, so agreeing with every peer over
  them is agreeing with every rank.

A difference raises :class:`~gossip.errors.ReplicaMismatchError` on the rank that sees it, naming the step, the
peer and both values. Periodic schedules were compared whole at construction and send nothing for W(t).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from gossip.backends.base import Communicator, Traffic
from gossip.errors import ReplicaMismatchError
from topologies import Schedule

DIGEST_BYTES = 32
TEXT_BYTES = 192
#: One message: the digest of W(t), the digest of the optimizer's kind, the kind's text (UTF-8, zero-padded).
MESSAGE_BYTES = 2 * DIGEST_BYTES + TEXT_BYTES
_NOTHING = bytes(DIGEST_BYTES)  # a digest not compared this step


def schedule_digest(schedule: Schedule, t: int) -> bytes:
    """The SHA-256 of W(t) in canonical coordinate form.

    Args:
        schedule: the schedule.
        t: the step.

    Returns:
        32 bytes.
    """
    digest = hashlib.sha256()
    for array in schedule.triplets(t):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.digest()


class PeerAgreement:
    """One rank's comparisons with its peers (module docstring).

    Args:
        comm: the wrapper's communicator.
        schedule: the wrapper's schedule.
        traffic: the account the messages' bytes are booked to (the wrapper's algorithm's step account).
    """

    def __init__(self, comm: Communicator, schedule: Schedule, traffic: Traffic | None = None):
        self.comm, self.schedule, self.traffic = comm, schedule, traffic
        #: compare W(t) from this step on (never for a periodic schedule: compared whole at construction)
        self.schedule_from: float = float("inf") if schedule.period is not None else schedule.window
        self.optimizer_kind: str | None = None
        self.optimizer_steps = range(0)  # the steps whose message carries the optimizer's kind
        self._pending: tuple[int, Any, list[tuple[int, torch.Tensor]]] | None = None

    def stop(self) -> None:
        """No more comparisons.

        For elastic runs: every member builds each member set's schedule alike, and a joiner compares its optimizer
        with its donor's.
        """
        self.schedule_from, self.optimizer_steps, self._pending = float("inf"), range(0), None

    def compare_optimizer(self, kind: str, step: int) -> None:
        """Compare ``kind`` with the peers of each of the next ``len(schedule.check_steps)`` steps.

        Args:
            kind: this rank's optimizer kind.
            step: the step of the first optimizer step (its message is already posted, without the kind).
        """
        self.optimizer_kind = kind
        self.optimizer_steps = range(step + 1, step + 1 + len(self.schedule.check_steps))

    def _message(self, step: int) -> bytes | None:
        compare_schedule = step >= self.schedule_from
        compare_optimizer = step in self.optimizer_steps
        if not (compare_schedule or compare_optimizer):
            return None
        scheduled = schedule_digest(self.schedule, step) if compare_schedule else _NOTHING
        kind = (self.optimizer_kind or "") if compare_optimizer else ""
        text = kind.encode()[:TEXT_BYTES]
        kind_digest = hashlib.sha256(kind.encode()).digest() if compare_optimizer else _NOTHING
        return scheduled + kind_digest + text + bytes(TEXT_BYTES - len(text))

    def post(self, step: int) -> None:
        """Post step ``step``'s message to W(t)'s peers, if the step compares anything (the same steps on every rank).

        Args:
            step: the step being started.
        """
        message = self._message(step)
        if message is None or self.schedule.n == 1:
            return
        view = self.schedule.peers(self.comm.rank, step)
        mine = torch.frombuffer(bytearray(message), dtype=torch.uint8).to(self.comm.device)
        received = [(peer, torch.empty_like(mine)) for peer, _ in view.in_peers]
        sends = [(peer, mine) for peer, _ in view.out_peers]
        handle = self.comm.exchange(sends, received, seq=step, traffic=self.traffic)
        self._pending = (step, (handle, mine), received)

    def check(self, step: int) -> None:
        """Wait for step ``step``'s messages and compare them with this rank's (at the optimizer step).

        Args:
            step: the step, the same on every rank.

        Raises:
            ReplicaMismatchError: a peer's W(t) or optimizer differs from this rank's; the message names both.
        """
        if self._pending is None or self._pending[0] != step:
            return
        _, (handle, mine), received = self._pending
        self._pending = None
        handle.wait()
        own = bytes(mine.cpu().numpy())
        for peer, message in received:
            theirs = bytes(message.cpu().numpy())
            where = f"step {step}: rank {self.comm.rank}"
            if theirs[:DIGEST_BYTES] != own[:DIGEST_BYTES]:
                raise ReplicaMismatchError(
                    f"{where}: peer {peer}'s schedule '{self.schedule.name}' has another W({step}) than this rank's "
                    f"(the same edges, other weights; construction compared the first {self.schedule.window} steps): "
                    "build it the same way on every rank (same seed)"
                )
            if theirs[DIGEST_BYTES : 2 * DIGEST_BYTES] != own[DIGEST_BYTES : 2 * DIGEST_BYTES]:
                their_kind = theirs[2 * DIGEST_BYTES :].rstrip(b"\0").decode(errors="replace")
                raise ReplicaMismatchError(
                    f"{where}: peer {peer}'s optimizer is {their_kind} where this rank's is {self.optimizer_kind}: "
                    "with gradient tracking or momentum tracking every rank must use the same optimizer with the "
                    "same second_moment_every"
                )

    def drain(self) -> None:
        """Complete a comparison in flight without checking it (``close()``, a checkpoint being loaded)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1][0].wait()
