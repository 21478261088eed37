"""experiments.scale.gap_curves: an arm's loss minus its DDP twin's, per seed and step."""

from __future__ import annotations

import pytest

from experiments.scale.gap_curves import gap_curves, main


def _rows(config, seed, losses):
    return [{"config": config, "seed": seed, "step": step, "avg_val_loss": loss} for step, loss in losses]


def test_the_gap_is_taken_per_seed_at_the_steps_both_runs_recorded():
    steps = _rows("arm", 0, [(10, 2.0), (20, 1.5), (30, 1.2)]) + _rows("ddp", 0, [(10, 1.9), (30, 1.25)])
    steps += _rows("arm", 1, [(10, 3.0)]) + _rows("ddp", 2, [(10, 1.0)]) + _rows("other", 0, [(10, 9.0)])
    curves = gap_curves(steps, "arm", "ddp")
    assert list(curves) == [0]  # seeds 1 and 2 have one run each
    assert [step for step, _ in curves[0]] == [10, 30]
    assert [gap for _, gap in curves[0]] == pytest.approx([0.1, -0.05])


def test_runs_that_share_no_seed_are_a_named_error():
    with pytest.raises(ValueError, match="no seed recorded for both 'arm' and 'ddq'"):
        gap_curves(_rows("arm", 0, [(10, 1.0)]) + _rows("ddp", 0, [(10, 1.0)]), "arm", "ddq")


def test_the_command_draws_one_panel_a_pair(tmp_path, capsys):
    lines = ["config,seed,step,avg_val_loss"]
    for seed in (0, 1):
        lines += [f"a,{seed},{s},{2 - s / 100}" for s in (10, 20)] + [f"d,{seed},{s},{2 - s / 90}" for s in (10, 20)]
    (tmp_path / "steps.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "gaps.png"
    assert main(["--steps", str(tmp_path / "steps.csv"), "--pair", "n = 2", "a", "d", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    assert "n = 2: 2 seeds, final gap +0.022 / +0.022" in capsys.readouterr().out
