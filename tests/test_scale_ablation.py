"""The scale ablation's early stop (experiments/scale/ablation.py): a prefix of the whole run, on its schedule."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from experiments.scale.ablation import CurrentGradientMomentumTrackingAdamW, MinMomentumTrackingAdamW, main

BETAS = (0.9, 0.95)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_a_stopped_run_is_the_first_steps_of_the_whole_run_and_does_not_count_as_it(tmp_path, capsys):
    common = ["--workers", "2", "--batch", "1", "--steps", "6", "--arms", "pipeline", "--record-every", "1"]
    main([*common, "--stop-after", "2", "--out", str(tmp_path)])
    main([*common, "--stop-after", "2", "--out", str(tmp_path)])  # done already: skipped
    main([*common, "--out", str(tmp_path)])  # the whole run is not done by the stopped one
    summary = _rows(tmp_path / "summary.csv")
    assert [row["step"] for row in summary] == ["2", "6"]
    steps = _rows(tmp_path / "steps.csv")
    stopped, whole = steps[:2], steps[2:]
    assert [row["step"] for row in stopped] == ["1", "2"] and [row["step"] for row in whole] == list("123456")
    for early, late in zip(stopped, whole[:2], strict=True):  # the same lr schedule: the same losses, bit for bit
        for key in ("train_loss", "avg_val_loss", "local_val_loss", "consensus"):
            assert early[key] == late[key], key


def test_a_stop_outside_the_run_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--steps", "6", "--stop-after", "7"])
    assert refused.value.code == 2
    assert "--stop-after must be in [1, --steps]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arm", "floor"), [("tracker-v", 0.0), ("tracker-3hops-tracked-v-nofloor", 0.0), ("pipeline", None)]
)
def test_the_diagnostics_hold_the_second_moment_read_off_the_tracker_and_the_sampled_one(tmp_path, capsys, arm, floor):
    """The library's ``second_moment="tracker"`` (arms ``tracker-v`` and ``-tracked-v-nofloor``) keeps no v_i, so it
    has no floor v_i / n to be active."""
    main(
        ["--workers", "2", "--batch", "1", "--steps", "3", "--arms", arm, "--record-every", "1", "--out", str(tmp_path)]
    )
    rows = _rows(tmp_path / "diagnostics.csv")
    assert [row["step"] for row in rows] == ["1", "2", "3"]
    assert all(float(row["signal_ratio"]) > 0 for row in rows)
    if floor is not None:
        assert {float(row["floor_active"]) for row in rows} == {floor}


def _denominators_without_a_tracker(kind: type) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Two steps of arm optimizer ``kind`` alone (z_i = h_i, no samples): per step the gradient, the rank's own
    bias-corrected v-hat, z-hat^2, the arm's denominator and the step number."""
    beta1, beta2 = BETAS
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = kind([weight], lr=0.1, betas=BETAS, second_moment_every=0)
    for step, gradient in enumerate([torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 4.0, -1.0])], start=1):
        weight.grad = gradient.clone()
        optimizer.prepare_momentum()
        state = optimizer.state[weight]
        first = weight.grad / (1 - beta1**step)
        own = state["v"] / (1 - beta2**step)
        got = optimizer.denominator(optimizer.param_groups[0], state, first)
        yield gradient, own, first.square(), got, step


def test_the_current_term_is_the_steps_own_gradient_where_the_tracker_is_the_first_moment():
    """Without a tracker (z_i = h_i), r_i = (h_t - beta1 h_{t-1}) / (1 - beta1) is the step's gradient, so the arm
    divides by Adam's recursion applied once more on top of the rank's own v-hat."""
    beta2 = BETAS[1]
    for gradient, own, floor, got, step in _denominators_without_a_tracker(CurrentGradientMomentumTrackingAdamW):
        expected = (beta2 * (1 - beta2 ** (step - 1)) * own + (1 - beta2) * gradient.square()) / (1 - beta2**step)
        torch.testing.assert_close(got, torch.maximum(expected, floor))


def test_the_smaller_second_moment_is_adams_own_where_the_tracker_is_the_first_moment():
    """Without a tracker the tracker's u_i is the rank's own v_i (r_i is each step's gradient), the current term is at
    most v-hat, so the -min arm divides by the library's own AdamW denominator max(v-hat, z-hat^2)."""
    for _, own, floor, got, _ in _denominators_without_a_tracker(MinMomentumTrackingAdamW):
        torch.testing.assert_close(got, torch.maximum(own, floor))
