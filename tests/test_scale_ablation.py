"""The scale ablation's early stop (experiments/scale/ablation.py): a prefix of the whole run, on its schedule."""

from __future__ import annotations

import copy
import csv
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from experiments.scale.ablation import (
    CurrentGradientMomentumTrackingAdamW,
    MinMomentumTrackingAdamW,
    SignFirstMomentumTrackingAdamW,
    arm_engine,
    config,
    main,
)
from experiments.scale.engine import Engine
from gossip.app.corpus import load_corpus
from gossip.app.train import TrainConfig, resolve
from optim import MomentumTrackingAdamW

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


def test_before_the_first_sample_the_sign_first_arm_steps_by_lr_in_the_first_moments_sign_then_as_the_library():
    """Until a sample arrives the arm divides by z-hat^2 alone (each coordinate moves by lr); after it, by the
    library's max(max(u-hat, v-hat / n), z-hat^2), bit for bit the library's update from the same state."""
    (beta1, _), lr, eps = BETAS, 0.1, 1e-8
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = SignFirstMomentumTrackingAdamW([weight], lr=lr, betas=BETAS, eps=eps, weight_decay=0.0)
    h = torch.zeros(3)
    for step, gradient in enumerate([torch.tensor([1.0, -2.0, 0.5]), torch.tensor([-3.0, 0.1, 0.4])], start=1):
        before = weight.detach().clone()
        weight.grad = gradient.clone()
        optimizer.step()
        h = beta1 * h + (1 - beta1) * gradient  # z_i = h_i without a tracker
        first = h / (1 - beta1**step)
        # the own v-hat (g^2 at step 1) differs from z-hat^2 at step 2: there only the floor gives lr a coordinate
        torch.testing.assert_close(weight.detach() - before, -lr * first / (first.abs() + eps))
    optimizer.take_mean_gradient({weight: torch.tensor([0.1, 3.0, -0.2])}, workers=4)
    twin = torch.nn.Parameter(weight.detach().clone())
    library = MomentumTrackingAdamW([twin], lr=lr, betas=BETAS, eps=eps, weight_decay=0.0)
    library.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # its own tensors
    for p, gradient in ((weight, torch.tensor([0.3, 4.0, -1.0])), (twin, torch.tensor([0.3, 4.0, -1.0]))):
        p.grad = gradient
    optimizer.step()
    library.step()
    assert torch.equal(weight, twin)


def _engine(arm: str) -> Engine:
    tiny = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 8, "warmup": 2, "second_moment_every": 4}
    return arm_engine(config(arm, 4, 1, 40).replace(**tiny), load_corpus(None, block_size=8).train)


def test_the_first_now_arm_is_the_all_reduced_twin_until_its_second_sample_which_arrives_as_gossip_does():
    """The first sample is handed over at once, as ``tracker-3hops-allreduce-v`` does, so the two arms are the
    same bit for bit until the second sample; that one is gossiped: it reaches the optimizer log2(n) steps after
    it was due."""
    now, twin = _engine("tracker-3hops-first-now"), _engine("tracker-3hops-allreduce-v")
    first = now.optimizer.param_groups[0]["params"][0]
    samples = []
    for step in range(7):
        now.step(step)
        twin.step(step)
        samples.append(now.optimizer.state[first]["samples"])
        if step < 4:  # the second sample is due at step 4
            assert torch.equal(now.parameters, twin.parameters), step
    assert samples == [1, 1, 1, 1, 1, 1, 2]  # due at step 4, mixed over steps 5 and 6 (log2 4 = 2 hops)
    assert not torch.equal(now.parameters, twin.parameters)


@pytest.mark.parametrize(
    ("arm", "base"),
    [
        ("ddp-warmup100", "ddp"),
        ("tracker-3hops-warmup100", "tracker-3hops"),
        ("tracker-3hops-allreduce-v-warmup100", "tracker-3hops-allreduce-v"),
        ("tracker-4hops-warmup100", "tracker-4hops"),
        ("tracker-3hops-float32-v-warmup100", "tracker-3hops-float32-v"),
    ],
)
def test_a_warm_up_arm_is_its_base_with_the_librarys_warm_up_for_1000_and_4000_steps(arm, base):
    """Only the warm-up differs from the base arm, it is what ``gossip-train`` resolves for 1000 and 4000 steps,
    and the engine's learning rate follows it: linear up to the peak at its last warm-up step."""
    long, short = config(arm, 16, 1, 4000), config(base, 16, 1, 4000)
    assert long.replace(name=short.name, warmup=short.warmup) == short
    for steps in (1000, 4000):
        assert long.warmup == resolve(TrainConfig(steps=steps), 16)[0].warmup_steps != short.warmup
    engine = arm_engine(long.replace(n_layer=1, n_embd=16, n_head=2, block_size=8), load_corpus(None, 8).train)
    rates = []
    for step in (49, long.warmup - 1):
        engine.step(step)
        rates.append(engine.optimizer.param_groups[0]["lr"])
    assert rates == [long.lr * 50 / long.warmup, long.lr]


@pytest.mark.parametrize(
    ("arm", "workers", "run"),
    [
        ("ddp-warmup100", 16, "n16-b4-ddp"),
        ("tracker-3hops-warmup100", 16, "n16-b4-pipeline"),
        ("ddp-warmup100", 64, "n64-b4-ddp"),
        ("tracker-4hops-warmup100", 64, "n64-b4-pipeline"),
    ],
)
def test_the_warm_up_arms_at_the_defaults_hops_are_the_weak_sweeps_runs(arm, workers, run):
    """So that the weak-scaling table may quote them: the same configuration under another name."""
    from experiments.scale.study import sweep

    (ours,) = [c for c in sweep("weak") if c.name == run]
    theirs = config(arm, workers, 4, 1000)
    assert theirs.warmup_steps() == ours.warmup_steps() == 100
    assert theirs.replace(name=run, warmup=None) == ours
