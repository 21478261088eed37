"""The main job's learning-rate schedule runs through torch.optim.lr_scheduler.LambdaLR, bit for bit the formula.

Writing ``learning_rate(config, step)`` into the param groups by hand and stepping a LambdaLR must give the same
bits at every step (so runs of the main job are unchanged by the scheduler; measured too: a 2-worker, 40-step run
gave identical losses, learning rates, validation losses and consensus distances on both ranks before and after).
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from gossip.app.train import TrainConfig, learning_rate, make_optimizer, make_scheduler, resolve, train_step


def _optimizer(config: TrainConfig) -> torch.optim.Optimizer:
    return make_optimizer(config, torch.nn.Linear(4, 3))


@pytest.mark.parametrize(("steps", "lr"), [(500, 3e-3), (40, 3e-3), (1000, 6e-4), (30, 1e-2)])
def test_lambda_lr_gives_exactly_the_formulas_learning_rate_at_every_step(steps, lr):
    config, _ = resolve(TrainConfig(steps=steps, lr=lr), world_size=4)
    optimizer = _optimizer(config)
    scheduler = make_scheduler(config, optimizer)
    assert isinstance(scheduler, LambdaLR)
    for step in range(steps):
        assert all(group["lr"] == learning_rate(config, step) for group in optimizer.param_groups), step
        optimizer.step()
        scheduler.step()


def test_train_step_steps_the_scheduler_after_the_optimizer():
    config, _ = resolve(TrainConfig(steps=10), world_size=1)
    model = _WithLoss(torch.nn.Linear(4, 4))
    optimizer = make_optimizer(config, model)
    scheduler = make_scheduler(config, optimizer)
    used = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    for _ in range(3):
        x = torch.randn(2, 4)
        train_step(model, optimizer, (x, x), scheduler)
    assert used == [learning_rate(config, step) for step in range(3)]
    assert scheduler.last_epoch == 3


class _WithLoss(torch.nn.Module):
    """The main job's model interface, ``model(x, y) -> (output, loss)``, around a plain module."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.inner(x)
        return out, torch.nn.functional.mse_loss(out, y)
