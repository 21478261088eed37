"""What the default pipeline sends during training: every collective and every exchange's peers, recorded.

A step's peers are the schedule's: W(t)'s for the parameters and the mean gradient's sample, and W(kt)'s, ...,
W(kt + k - 1)'s for the trackers' k hops above 8 ranks (:func:`step_peers`).

:func:`record` replaces a communicator's public operations by recording versions (the algorithms, the wrapper and
the samplers reach the network only through them); :func:`default_pipeline_run` trains with ``gossip.wrap``'s
pipeline and returns what was issued between the first step and ``close()``. Run on the simulator and, through
``collective_worker.py``, on Gloo and MPI (tests/test_no_world_collectives.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import gossip
from helpers.parallel_scenarios import batch, loss_of, make_mlp

COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather_object")
STEPS = 72  # past the second sample of the mean gradient (due at steps 0 and 64, a few hops each)


class Recorder:
    """Collectives and exchanges issued while ``training`` is set, with the wrapper's step at the time."""

    def __init__(self) -> None:
        self.training = False
        self.collectives: list[tuple[int, str]] = []
        self.exchanges: list[tuple[int, set[int]]] = []
        self.model: Any = None

    def step(self) -> int:
        return -1 if self.model is None else self.model.step_count


def record(comm: gossip.Communicator, recorder: Recorder) -> None:
    """Make ``comm`` report its collectives and exchanges to ``recorder`` (while it is ``training``)."""
    for name in COLLECTIVES:
        original = getattr(comm, name)

        @functools.wraps(original)
        def collective(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            if recorder.training:
                recorder.collectives.append((recorder.step(), _name))
            return _original(*args, **kwargs)

        setattr(comm, name, collective)
    original_start = comm.start_planned  # exchange() goes through start_planned

    def start_planned(plan: Any, **kwargs: Any) -> Any:
        if recorder.training:
            peers = {transfer.peer for transfer in (*plan.sends, *plan.recvs)}
            recorder.exchanges.append((recorder.step(), peers))
        return original_start(plan, **kwargs)

    comm.start_planned = start_planned


def step_peers(schedule: Any, rank: int, step: int, hops: int) -> set[int]:
    """The peers ``rank`` may meet at ``step``: W(step)'s (the parameters, the mean gradient's sample) and
    W(hops * step), ..., W(hops * step + hops - 1)'s (the trackers' hops)."""
    views = [schedule.peers(rank, s) for s in (step, *range(hops * step, hops * step + hops))]
    return {peer for view in views for peer, _ in (*view.in_peers, *view.out_peers)}


def default_pipeline_run(
    comm: gossip.Communicator, mean_gradient: str = "gossip", second_moment: str = "sample"
) -> dict[str, Any]:
    """``STEPS`` steps of the default pipeline (``gossip.wrap``) on the MLP, its second moment sampled every 64
    steps or (``second_moment="tracker"``) read off the trackers; what the training issued."""
    recorder = Recorder()
    record(comm, recorder)
    pipeline = gossip.Pipeline(rank=2, mean_gradient=mean_gradient, second_moment=second_moment)
    model, optimizer = gossip.wrap(make_mlp(comm.rank), comm, lr=1e-2, pipeline=pipeline)
    recorder.model = model
    losses = []
    for step in range(STEPS):
        recorder.training = True  # from the first step (its exchange starts at the first forward) ...
        loss = loss_of(model, *batch(comm.rank, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    recorder.training = False  # ... to close()
    hops = model.tracker.hops
    stray = [
        (step, sorted(peers - allowed))
        for step, peers in recorder.exchanges
        for allowed in [step_peers(model.schedule, comm.rank, step, hops)]
        if not peers <= allowed
    ]
    samples = optimizer.state[next(iter(model.parameters()))]["samples"]
    model.close()
    return {
        "collectives": recorder.collectives,
        "stray": stray,
        "tracker_hops": hops,
        "hop_peers": sum(
            not peers <= step_peers(model.schedule, comm.rank, step, 1) for step, peers in recorder.exchanges
        ),
        "exchanges": len(recorder.exchanges),
        "steps_with_exchanges": len({step for step, _ in recorder.exchanges}),
        "samples": samples,
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / 10,
        "schedule": model.schedule.name,
    }


def run_all(comm: gossip.Communicator) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"gossip": default_pipeline_run(comm), "tracker": default_pipeline_run(comm, second_moment="tracker")}
