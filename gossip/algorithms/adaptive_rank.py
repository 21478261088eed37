"""Adaptive PowerGossip rank: GraVAC's compression-throughput search over a ladder of ranks (docs/design.md C.4).

GraVAC (Tyagi & Swany, IEEE CLOUD 2023; C.1-C.2) picks a compression factor maximising the compression
throughput CT = throughput x gain subject to gain >= epsilon. Mapped onto PowerGossip (C.4):

* knob: the rank r, moved along a ladder (1, 2, 4, 8, ...);
* gain: the fraction of the neighbour difference D = X_hi - X_lo the exchanged factors capture. After a
  right-multiplication iteration both ends hold P = D q with q orthonormal, so ||P||_F^2 is the energy of D in
  span(q) (after a left one, ||Q||_F^2 = ||D^T p||_F^2). The denominator ||D||_F^2 is estimated from s shared
  coordinates per matrix (F.4 item 2, stratified by matrix): every rank draws the same indices from (seed,
  step), sends those s values of each compressed matrix to its peers alongside the PowerGossip message, and
  both ends compute sum_l (numel_l / s_l) ||x_i[idx_l] - x_j[idx_l]||^2 (unbiased; exact when s >= numel).
  gain = EWMA(sum ||P||^2) / EWMA(sum est ||D||^2) over the window (EWMA alpha 0.05 as GraVAC);
* throughput: 1 / (wall-clock time between successive ``start`` calls), averaged over ranks.

Every ``every`` steps all ranks all-gather (numerator, denominator, seconds, steps, reopen request) and sum
them in rank order, so every rank takes the same decision at the same step. :class:`LadderSearch` then moves
up the ladder; it stops when the two best CT values are within omega (keeping the smaller rank of the two,
C.2), when CT fell at the new rung while the previous one met epsilon, or at the top of the ladder. A rank
change is synchronous on both ends of every edge and keeps the warm factors: increasing appends columns to p
and q drawn from the edge's pair-seeded generator (identical on both ends, in matrix order, p before q);
decreasing drops trailing columns (after Gram-Schmidt the leading ones carry the dominant directions). The
search re-opens (from the bottom rung) after ``reopen()`` -- e.g. at a learning-rate drop, called on any rank
-- or when the sketched mean pair distance exceeds ``distance_target``.

Which matrices are compressed is decided once, at the top rung's rank, so every rung is valid for all of them.
With ``num_iterations > 1`` the gain uses the last iteration's factors against the start-of-step difference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms.buckets import Bucket
from gossip.algorithms.powergossip import PowerGossip
from gossip.backends.base import Communicator
from gossip.backends.comm_thread import Handle
from gossip.errors import InvalidArgumentError
from topologies import Schedule


class LadderSearch:
    """GraVAC's search (C.2, C.4) over a rank ladder: feed ``record(gain, throughput)`` once per window.

    Args:
        ladder: the ranks to search, strictly increasing integers >= 1.
        epsilon: the least gain a rung must reach, in (0, 1].
        omega: the search stops when the two best CT values are within this relative margin.

    Raises:
        InvalidArgumentError: ``ladder`` is empty, not strictly increasing or holds a non-integer or a value
            below 1, or ``epsilon`` or ``omega`` is out of range.
    """

    def __init__(self, ladder: Sequence[int], epsilon: float = 0.75, omega: float = 0.05):
        ladder = tuple(ladder)
        if not ladder or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in ladder):
            raise InvalidArgumentError(
                f"LadderSearch: ladder must be a non-empty sequence of integers >= 1, got {ladder!r}"
            )
        if list(ladder) != sorted(set(ladder)):
            raise InvalidArgumentError(f"LadderSearch: ladder must be strictly increasing, got {ladder!r}")
        if not 0 < epsilon <= 1 or not omega > 0:
            raise InvalidArgumentError(f"LadderSearch: need 0 < epsilon <= 1 and omega > 0, got {epsilon}, {omega}")
        self.ladder, self.epsilon, self.omega = ladder, float(epsilon), float(omega)
        self.reopen()

    def reopen(self) -> None:
        """Forget the recorded gains and throughputs and start again from the bottom rung."""
        self.rank, self.searching = self.ladder[0], True
        self.measured: dict[int, tuple[float, float]] = {}  # rank -> (gain, CT)

    def _finish(self, rank: int) -> int:
        self.rank, self.searching = rank, False
        return rank

    def record(self, gain: float, throughput: float) -> int:
        """Store the current rung's gain and CT = throughput x gain; return the rank for the next window.

        Args:
            gain: the fraction of the neighbour difference the factors captured over the window.
            throughput: steps per second over the window.

        Returns:
            The rank to use next (the same rung once the search has stopped).
        """
        self.measured[self.rank] = (gain, throughput * gain)
        if not self.searching:
            return self.rank
        feasible = {r: ct for r, (g, ct) in self.measured.items() if g >= self.epsilon}
        ranked = sorted(feasible, key=lambda r: (-feasible[r], r))
        if len(ranked) >= 2 and feasible[ranked[1]] > 0:
            best, second = feasible[ranked[0]], feasible[ranked[1]]
            if (best - second) / second < self.omega:
                return self._finish(min(ranked[0], ranked[1]))
        index = self.ladder.index(self.rank)
        previous = self.ladder[index - 1] if index > 0 else None
        if previous in feasible and self.measured[self.rank][1] < feasible[previous]:
            return self._finish(ranked[0])
        if index + 1 < len(self.ladder):
            self.rank = self.ladder[index + 1]
            return self.rank
        if ranked:
            return self._finish(ranked[0])
        return self._finish(max(self.measured, key=lambda r: (self.measured[r][0], r)))


@dataclass
class _Pending:
    step: int
    round: Any
    peers: list[int]
    sketch: torch.Tensor | None
    received: list[torch.Tensor]
    handle: Handle | None


class AdaptivePowerGossip(PowerGossip):
    """PowerGossip whose rank follows :class:`LadderSearch`, decided globally every ``every`` steps.

    Args:
        ladder: the ranks to search (see :class:`LadderSearch`).
        every: steps per window between decisions, an integer >= 2.
        epsilon: the least gain a rung must reach.
        omega: the relative margin of CT at which the search stops.
        sketch_size: shared coordinates per matrix that estimate ||X_hi - X_lo||_F^2, an integer >= 1.
        alpha: the EWMA weight of the gain's numerator and denominator, in (0, 1].
        distance_target: re-open the search when the sketched mean pair distance exceeds it; None never does.
        clock: the clock that times the windows (seconds).
        **powergossip: further :class:`PowerGossip` settings (its ``rank`` is the ladder's bottom rung).

    Raises:
        InvalidArgumentError: ``every``, ``sketch_size`` or ``alpha`` is out of range.
    """

    can_delay = False  # it rebuilds its edges when the rank changes, so no exchange may outlive a step

    name = "adaptive-powergossip"
    state_dict_is_snapshot = True  # PowerGossip's, and a copy of the search's numbers

    def __init__(
        self,
        ladder: Sequence[int] = (1, 2, 4, 8),
        every: int = 200,
        epsilon: float = 0.75,
        omega: float = 0.05,
        *,
        sketch_size: int = 64,
        alpha: float = 0.05,
        distance_target: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        **powergossip: Any,
    ):
        self.search = LadderSearch(ladder, epsilon, omega)
        super().__init__(rank=self.search.rank, **powergossip)
        if isinstance(every, bool) or not isinstance(every, int) or every < 2:
            raise InvalidArgumentError(
                f"AdaptivePowerGossip: every must be an integer >= 2 (steps per window), got {every!r}"
            )
        if isinstance(sketch_size, bool) or not isinstance(sketch_size, int) or sketch_size < 1:
            raise InvalidArgumentError(f"AdaptivePowerGossip: sketch_size must be an integer >= 1, got {sketch_size!r}")
        if not 0 < alpha <= 1:
            raise InvalidArgumentError(f"AdaptivePowerGossip: alpha must be in (0, 1], got {alpha}")
        self.every, self.sketch_size, self.alpha = every, sketch_size, float(alpha)
        self.distance_target, self.clock = distance_target, clock
        self.history: list[dict[str, Any]] = []
        self._reopen_requested = False
        self._reset_window()

    def setup(self, comm: Communicator, schedule: Schedule | None, buckets: list[Bucket]) -> None:
        """Bind as :meth:`PowerGossip.setup`, choosing the compressed matrices at the top rung's rank.

        Args:
            comm: this rank's communicator.
            schedule: the gossip schedule.
            buckets: the parameter buckets to mix in place.
        """
        super().setup(comm, schedule, buckets)
        self._last_start: float | None = None

    def largest_matrix_rank(self) -> int:
        """The ladder's top rung: the compressed matrices are chosen so that every rung fits them.

        Returns:
            The largest rank of the ladder.
        """
        return self.search.ladder[-1]

    def _reset_window(self) -> None:
        self._numerator = self._denominator = None
        self._seconds, self._steps, self._pair_distance, self._edges = 0.0, 0, 0.0, 0

    # -- rank changes ---------------------------------------------------------------------------------------
    def set_rank(self, new_rank: int) -> None:
        """Change the rank of every edge now (call at the same step on every rank), keeping the warm factors.

        Args:
            new_rank: the new rank, an integer >= 1 that every compressed matrix allows.

        Raises:
            InvalidArgumentError: ``new_rank`` is not an integer >= 1, or exceeds min(m, k) of a compressed matrix.
        """
        if isinstance(new_rank, bool) or not isinstance(new_rank, int) or new_rank < 1:
            raise InvalidArgumentError(f"rank {self.comm.rank}: set_rank needs an integer >= 1, got {new_rank!r}")
        for matrix in self.matrices:
            if new_rank > min(matrix.m, matrix.k):
                raise InvalidArgumentError(
                    f"rank {self.comm.rank}: set_rank({new_rank}): parameter {matrix.entry.name!r} of shape "
                    f"{tuple(matrix.entry.shape)} allows at most rank {min(matrix.m, matrix.k)}"
                )
        extra = new_rank - self.matrix_rank
        self.matrix_rank = new_rank
        for key in sorted(self.edges):
            edge = self.edges[key]
            p, q = edge.p, edge.q
            for i, matrix in enumerate(self.matrices):
                if extra > 0:
                    p_new = edge.draw(matrix.m, extra, self._device, self._dtype)
                    q_new = edge.draw(matrix.k, extra, self._device, self._dtype)
                    p[i], q[i] = torch.cat([p[i], p_new], 1), torch.cat([q[i], q_new], 1)
                else:
                    p[i], q[i] = p[i][:, :new_rank], q[i][:, :new_rank]
            edge.set_factors(self.groups, self._layout(), p, q, self._dtype, self._device)

    def reopen(self) -> None:
        """Ask for a new search from the bottom rung at the next decision (any one rank asking is enough)."""
        self._reopen_requested = True

    # -- the shared-coordinate sketch -----------------------------------------------------------------------
    def _coordinates(self, step: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        sizes = [m.m * m.k for m in self.matrices]
        return [
            torch.randint(n, (self.sketch_size,), generator=generator) if n > self.sketch_size else torch.arange(n)
            for n in sizes
        ]

    def _sketch(self, coordinates: list[torch.Tensor]) -> torch.Tensor:
        values = [
            self._matrix(m).reshape(-1)[idx.to(self._device)] for m, idx in zip(self.matrices, coordinates, strict=True)
        ]
        return torch.cat(values)

    # -- the Algorithm interface ----------------------------------------------------------------------------
    def _start_step(self, step: int) -> _Pending:
        now = self.clock()
        if self._last_start is not None:
            self._seconds += now - self._last_start
            self._steps += 1
        self._last_start = now
        round_ = super()._start_step(step)
        peers = [peer for peer, _ in self.schedule.peers(self.comm.rank, step).in_peers]
        if not self.matrices or not peers:
            return _Pending(step, round_, peers, None, [], None)
        coords = self._coordinates(step)
        self._scales = [m.m * m.k / idx.numel() for m, idx in zip(self.matrices, coords, strict=True)]
        self._counts = [idx.numel() for idx in coords]
        sketch = self._sketch(coords)
        received = [torch.empty_like(sketch) for _ in peers]
        handle = self._exchange([(p, sketch) for p in peers], list(zip(peers, received, strict=True)), round_.seq)
        return _Pending(step, round_, peers, sketch, received, handle)

    def _finish_step(self, pending: _Pending) -> None:
        if pending.handle is not None:
            self._wait(pending.handle)
        super()._finish_step(pending.round)
        if pending.handle is not None:
            self._measure(pending)
        if (pending.step + 1) % self.every == 0:
            self._decide(pending.step)

    def _measure(self, pending: _Pending) -> None:
        me, numerator, denominator = self.comm.rank, 0.0, 0.0
        for peer, theirs in zip(pending.peers, pending.received, strict=True):
            edge = self.edges[tuple(sorted((me, peer)))]
            right = (edge.iteration - 1) % 2 == 1  # the side of the iteration just applied
            factors = edge.p if right else edge.q
            numerator += float(sum(torch.linalg.vector_norm(f.double()) ** 2 for f in factors))
            offset = 0
            for scale, count in zip(self._scales, self._counts, strict=True):
                gap = (pending.sketch[offset : offset + count] - theirs[offset : offset + count]).double()
                denominator += scale * float(gap @ gap)
                offset += count
        self._pair_distance += denominator
        self._edges += len(pending.peers)
        if self._numerator is None:
            self._numerator, self._denominator = numerator, denominator
        else:
            self._numerator += self.alpha * (numerator - self._numerator)
            self._denominator += self.alpha * (denominator - self._denominator)

    def _decide(self, step: int) -> None:
        local = (self._numerator or 0.0, self._denominator or 0.0, self._seconds, self._steps)
        gathered = self.comm.all_gather_object((*local, self._pair_distance, self._edges, self._reopen_requested))
        numerator = sum(g[0] for g in gathered)
        denominator = sum(g[1] for g in gathered)
        step_seconds = [g[2] / g[3] for g in gathered if g[3]]
        gain = numerator / denominator if denominator > 0 else 1.0
        throughput = len(step_seconds) / sum(step_seconds) if step_seconds and sum(step_seconds) > 0 else 1.0
        edges = sum(g[5] for g in gathered)
        distance = sum(g[4] for g in gathered) / edges if edges else 0.0
        reopen = any(g[6] for g in gathered) or (
            self.distance_target is not None and not self.search.searching and distance > self.distance_target
        )
        rank = self.matrix_rank
        new_rank = self.search.record(gain, throughput)
        if reopen:
            self.search.reopen()
            new_rank = self.search.rank
        self.history.append(
            {"step": step + 1, "rank": rank, "gain": gain, "throughput": throughput, "ct": gain * throughput,
             "pair_distance": distance, "reopened": reopen, "next_rank": new_rank, "searching": self.search.searching}
        )  # fmt: skip
        if new_rank != self.matrix_rank:
            self.set_rank(new_rank)
        self._reopen_requested = False
        self._reset_window()

    # -- state ----------------------------------------------------------------------------------------------
    def config(self) -> dict:
        """The settings every rank must share: PowerGossip's but its rank, with the ladder and the search's.

        Returns:
            Setting name -> value.
        """
        config = {k: v for k, v in super().config().items() if k != "rank"}
        return {**config, "ladder": list(self.search.ladder), "every": self.every, "epsilon": self.search.epsilon,
                "omega": self.search.omega, "sketch_size": self.sketch_size, "alpha": self.alpha}  # fmt: skip

    def state_dict(self) -> dict:
        """PowerGossip's state with the search's: the current rank, whether it is searching, and each rung's record.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        search = {"rank": self.matrix_rank, "searching": self.search.searching, "measured": dict(self.search.measured)}
        return {**super().state_dict(), "search": search}

    def load_state_dict(self, state: dict) -> None:
        """Restore the state :meth:`state_dict` returned, rank included.

        Args:
            state: what :meth:`state_dict` returned.
        """
        super().load_state_dict(state)
        search = state["search"]
        self.matrix_rank = self.search.rank = search["rank"]
        self.search.searching, self.search.measured = search["searching"], dict(search["measured"])
