"""Mixing rules of the learning-per-step study that the library does not have (harness-level): no mixing at all,
and CHOCO-Gossip with top-k compression as the error-feedback comparison point (the scaled-sign CHOCO-Gossip the
study tried for the trackers is the library's :class:`gossip.ChocoSign`). Used by
:mod:`experiments.learning_per_step`."""

from __future__ import annotations

import math

import torch

from gossip.algorithms.base import Algorithm


class NoMixing(Algorithm):
    """No communication: every rank keeps its own replica (the drift that mixing has to remove)."""

    name = "none"

    def _start_step(self, step: int) -> None:
        return None

    def _finish_step(self, pending: None) -> None:
        return None


class ChocoTopK(Algorithm):
    r"""CHOCO-Gossip with top-k compression on a static symmetric schedule (Koloskova et al., ICML 2019, Alg. 1).

    Each rank keeps public copies :math:`\hat x_j` of itself and of its neighbours (identical on every rank that
    holds them). Per step: :math:`q_i = \mathrm{top}_k(x_i - \hat x_i)` is sent to the neighbours (values float32 +
    indices int32); every holder adds :math:`q_j` to :math:`\hat x_j`; then
    :math:`x_i \leftarrow x_i + \gamma \sum_j W_{ij} (\hat x_j - \hat x_i)`. What top-k leaves out stays in
    :math:`x_i - \hat x_i` and is sent later (error feedback). With symmetric W the sum over ranks is preserved.
    """

    name = "choco"
    needs_symmetric_schedule = True

    def __init__(self, fraction: float, gamma: float):
        if not 0 < fraction <= 1:
            raise ValueError(f"ChocoTopK: fraction must be in (0, 1], got {fraction}")
        if not gamma > 0:
            raise ValueError(f"ChocoTopK: gamma must be positive, got {gamma}")
        self.fraction, self.gamma = fraction, gamma

    def setup(self, comm, schedule, buckets) -> None:
        super().setup(comm, schedule, buckets)
        view = schedule.peers(comm.rank, 0)
        for t in range(1, schedule.period or 1):
            if schedule.peers(comm.rank, t).in_peers != view.in_peers:
                raise ValueError(f"ChocoTopK needs a static schedule; rank {comm.rank}'s peers change at step {t}")
        self.neighbours = view.in_peers
        # x_hat = 0 on every holder (Alg. 1's initialisation): identical everywhere whatever the replicas hold
        self.public = {p: [torch.zeros_like(b.buffer) for b in buckets] for p, _ in (*view.in_peers, (comm.rank, 1))}

    def _start_step(self, step: int) -> tuple[list, list]:
        own, sends, recvs, received = self.public[self.comm.rank], [], [], []
        mine = []
        for bucket, public in zip(self.buckets, own, strict=True):
            residual = bucket.buffer - public
            k = max(1, math.ceil(self.fraction * residual.numel()))
            indices = residual.abs().topk(k, sorted=False).indices
            mine.append((indices.to(torch.int32), residual[indices].clone()))
        for peer, _ in self.neighbours:
            incoming = []
            for indices, values in mine:
                sends += [(peer, indices), (peer, values)]
                pair = (torch.empty_like(indices), torch.empty_like(values))
                recvs += [(peer, pair[0]), (peer, pair[1])]
                incoming.append(pair)
            received.append(incoming)
        return mine, [self._exchange(sends, recvs, step), received]

    def _finish_step(self, pending: tuple[list, list]) -> None:
        mine, (handle, received) = pending
        self._wait(handle)
        updates = [(self.comm.rank, mine)] + [(p, r) for (p, _), r in zip(self.neighbours, received, strict=True)]
        for peer, pairs in updates:
            for public, (indices, values) in zip(self.public[peer], pairs, strict=True):
                public.index_add_(0, indices.long(), values)
        own = self.public[self.comm.rank]
        for index, bucket in enumerate(self.buckets):
            correction = torch.zeros_like(bucket.buffer)
            for peer, weight in self.neighbours:
                correction.add_(self.public[peer][index] - own[index], alpha=weight)
            bucket.buffer.add_(correction, alpha=self.gamma)
