"""The per-phase work count of the main job's step (experiments/time_to_loss/work_per_phase.py)."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

import gossip
from experiments.time_to_loss.work_per_phase import PHASES, _Counts, _Operations, count, count_at, main, table

OPTIONS = ["--batch-size", "2", "--eval-every", "100"]


def test_the_operations_do_not_depend_on_the_run_and_every_phase_of_a_gossip_step_does_some_work(tmp_path):
    """Counting, not timing: two runs of the same code count the same operations, whatever the machine's load (an
    average every 2 steps puts an all-reduce in the counted steps, whose sum the simulator does on whichever rank
    arrives last), except how ``progress`` and ``finish`` share the exchange, which the peer's arrival decides; and
    nearly the same Python calls where timing does not decide (it does for a wait's polling and the progress bar)."""
    options = [*OPTIONS, "--outer-every", "2"]
    first = count(2, 3, 1, options, str(tmp_path / "a"))
    second = count(2, 3, 1, options, str(tmp_path / "b"))
    arrival_decides = ("progress", "finish")
    assert {p: n for p, n in first["ops"].items() if p not in arrival_decides} == {
        p: n for p, n in second["ops"].items() if p not in arrival_decides
    }
    for phase in ("forward+backward", "update", "posting"):
        assert first["calls"][phase] == pytest.approx(second["calls"][phase], rel=0.02, abs=20), phase
    assert first["steps"] == 2 and set(first["ops"]) == set(first["calls"]) == set(PHASES)
    for phase in ("forward+backward", "finish", "update", "posting"):
        assert first["ops"][phase] > 0 and first["calls"][phase] > 0, phase


def test_the_exchange_run_during_backward_is_counted_apart_from_the_model(tmp_path, monkeypatch):
    """Whether PowerGossip's further iterations run in the backward hooks (their exchange arrived in time) or all in
    ``finish`` (it did not) changes ``progress`` and ``finish`` only: the model's forward and backward count the
    same. Both arrivals are forced: every iteration posted early (``wait``), or none."""
    from gossip.algorithms.powergossip import PowerGossip

    progress = PowerGossip.progress
    options = [*OPTIONS, "--outer-every", "2"]
    monkeypatch.setattr(PowerGossip, "progress", lambda self, pending, wait=False: progress(self, pending, True))
    early = count(2, 3, 1, options, str(tmp_path / "early"))
    monkeypatch.setattr(
        PowerGossip, "progress", lambda self, pending, wait=False: wait and progress(self, pending, True)
    )
    late = count(2, 3, 1, options, str(tmp_path / "late"))
    assert early["ops"]["progress"] > 0 == late["ops"]["progress"]
    assert late["ops"]["finish"] > early["ops"]["finish"] > 0
    for phase in ("forward+backward", "update", "posting", "metrics", "loop"):
        assert early["ops"][phase] == late["ops"][phase], phase


def _rank_0_all_reduce_operations(rank_0_last: bool, leave_out: bool) -> tuple[int, list[torch.Tensor]]:
    """Rank 0's counted operations for one all-reduce of two simulated ranks, rank 0 arriving last or first."""
    counts = _Counts()

    def arrived(comm, rank: int) -> bool:
        with comm._world.cond:
            return rank in comm._world.rounds.get(0, {})

    def worker(comm) -> torch.Tensor:
        tensor = torch.full((4,), float(comm.rank + 1))
        other = 1 - comm.rank
        if (comm.rank == 0) == rank_0_last:  # the rank that must come last waits for the other to arrive
            deadline = time.monotonic() + 30
            while not arrived(comm, other):
                assert time.monotonic() < deadline, f"rank {other} never reached the all-reduce"
                time.sleep(0.001)
        if comm.rank != 0:
            comm.all_reduce(tensor)
            return tensor
        if leave_out:
            counts.leave_out_collective_sums(comm)
        counts.counting = True
        with _Operations(counts):
            comm.all_reduce(tensor)
        counts.counting = False
        return tensor

    results = gossip.simulate(2, worker)
    return counts.ops["loop"], results


def test_rank_0_counts_the_same_for_a_collective_whether_it_arrives_first_or_last():
    """The simulator sums a collective on the rank that arrives last; that shared sum is left out of the count, so
    the count does not depend on the order of arrival (and it would without the mend: the check can fail)."""
    last, summed_last = _rank_0_all_reduce_operations(rank_0_last=True, leave_out=True)
    first, summed_first = _rank_0_all_reduce_operations(rank_0_last=False, leave_out=True)
    assert last == first > 0
    for tensor in (*summed_last, *summed_first):
        assert torch.equal(tensor, torch.full((4,), 3.0))  # the sum is still done, only not counted
    counted_last, _ = _rank_0_all_reduce_operations(rank_0_last=True, leave_out=False)
    counted_first, _ = _rank_0_all_reduce_operations(rank_0_last=False, leave_out=False)
    assert counted_last > counted_first == first


def test_the_table_shows_each_result_the_whole_step_and_the_difference():
    def result(scale: float) -> dict:
        return {
            "ops": {phase: scale * (i + 1) for i, phase in enumerate(PHASES)},
            "calls": {phase: 10 * scale for phase in PHASES},
        }

    lines = table({"old": result(1.0), "new": result(2.0)}).splitlines()
    ops_step = next(line for line in lines if line.split()[0] == "step")
    total = sum(range(1, len(PHASES) + 1))
    assert ops_step.split() == ["step", f"{total:.1f}", f"{2 * total:.1f}", f"+{total:.1f}"]  # 1 + ... + 7, doubled
    assert "last - first" in lines[0] and "Python calls per step" in lines[len(PHASES) + 2]


def test_a_skip_outside_the_run_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--steps", "4", "--skip", "4"])
    assert refused.value.code == 2
    assert "--skip must be in [0, --steps)" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_revision_is_counted_from_its_own_worktree():
    """count_at refuses a result whose gossip came from anywhere but the worktree of the revision."""
    args = argparse.Namespace(ranks=2, steps=2, skip=1, options=OPTIONS)
    result = count_at("HEAD", args)
    assert result["gossip"] == "HEAD (worktree)"
    assert result["steps"] == 1 and result["ops"]["forward+backward"] > 0
