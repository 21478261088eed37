"""The per-phase work count of the main job's step (experiments/time_to_loss/work_per_phase.py)."""

from __future__ import annotations

import argparse

import pytest

from experiments.time_to_loss.work_per_phase import PHASES, count, count_at, main, table

OPTIONS = ["--batch-size", "2", "--eval-every", "100"]


def test_the_operations_do_not_depend_on_the_run_and_every_phase_of_a_gossip_step_does_some_work(tmp_path):
    """Counting, not timing: two runs of the same code count the same operations, whatever the machine's load (no
    collective falls in the counted steps: the simulator sums one on whichever rank arrives last), and nearly the same
    Python calls where timing does not decide (it does for a wait's polling and the progress bar)."""
    first = count(2, 3, 1, OPTIONS, str(tmp_path / "a"))
    second = count(2, 3, 1, OPTIONS, str(tmp_path / "b"))
    assert first["ops"] == second["ops"]
    for phase in ("forward+backward", "update", "posting"):
        assert first["calls"][phase] == pytest.approx(second["calls"][phase], rel=0.02, abs=20), phase
    assert first["steps"] == 2 and set(first["ops"]) == set(first["calls"]) == set(PHASES)
    for phase in ("forward+backward", "finish", "update", "posting"):
        assert first["ops"][phase] > 0 and first["calls"][phase] > 0, phase


def test_the_table_shows_each_result_the_whole_step_and_the_difference():
    def result(scale: float) -> dict:
        return {
            "ops": {phase: scale * (i + 1) for i, phase in enumerate(PHASES)},
            "calls": {phase: 10 * scale for phase in PHASES},
        }

    lines = table({"old": result(1.0), "new": result(2.0)}).splitlines()
    ops_step = next(line for line in lines if line.split()[0] == "step")
    assert ops_step.split() == ["step", "21.0", "42.0", "+21.0"]  # 1 + ... + 6, doubled
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
