"""The main job's training loop (``gossip.app.train.run_steps``), which the replicated and the sharded jobs share:
what it logs, when it validates, and the named error when the loss stops being finite."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gossip.app.train import LoopResult, TrainConfig, run_steps
from gossip.errors import NonFiniteError


class _Logged(nn.Module):
    """A one-weight model whose loss is ``weight * x`` (``x`` the batch), keeping the rows the loop logs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.rows: list[dict] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, self.weight * x

    def log(self, **row: float) -> None:
        self.rows.append(row)


class _Batches:
    """``batch(step)``: the step's value as a 0-d tensor, from a list."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.values[step]), torch.tensor(0.0)


def _run(values: list[float], eval_every: int, where: str = "rank 0") -> tuple[_Logged, list[int], LoopResult]:
    config = TrainConfig(steps=len(values), eval_every=eval_every, log_every=1)
    model = _Logged()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    validated: list[int] = []

    def validate() -> float:
        validated.append(len(model.rows))
        return float(len(validated))

    result = run_steps(config, model, optimizer, scheduler, _Batches(values), validate, 1, 2, where)
    return model, validated, result


def test_every_step_is_logged_and_validation_runs_before_every_eval_every_steps_and_at_the_last():
    model, validated, result = _run([1.0, 2.0, 3.0, 4.0, 5.0], eval_every=2)
    assert result.losses == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [row["loss"] for row in model.rows] == result.losses
    assert validated == [0, 1, 3, 4]  # rows logged when called: before step 1, at steps 2 and 4 of 5, at the last
    assert [("val_loss" in row) for row in model.rows] == [False, True, False, True, True]
    assert [row["val_loss"] for row in model.rows if "val_loss" in row] == [2.0, 3.0, 4.0]
    assert (result.initial_validation, result.final_validation) == (1.0, 4.0)  # the first and the last values
    assert result.seconds >= model.rows[-1]["elapsed_seconds"] >= 0


def test_without_steps_the_final_validation_is_the_initial_one():
    model, validated, result = _run([], eval_every=2)
    assert (result.losses, validated, model.rows) == ([], [0], [])
    assert result.initial_validation == result.final_validation == 1.0


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_loss_that_is_not_finite_is_a_named_error_at_its_step(value):
    named = r"rank 3 \(replica 1, shard 0\): training loss is .* at step 2; lower --lr"
    with pytest.raises(NonFiniteError, match=named):
        _run([1.0, 2.0, value, 4.0], eval_every=10, where="rank 3 (replica 1, shard 0)")
