"""The order of one step under DecentralizedDataParallel (docs/design.md B.1, G), on the simulator.

Shown by instrumentation, not timing: a recording algorithm logs start(t)/finish(t), a forward hook logs
forward(t), the optimizer logs update(t).
"""

from __future__ import annotations

import pytest
import torch
from helpers.parallel_scenarios import batch, loss_of, make_mlp, train, wrap

import gossip
import optim
from gossip.algorithms.exact import ExactGossip

N = 4


class RecordingGossip(ExactGossip):
    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def _start_step(self, step: int):
        self.log.append(f"start({step})")
        return super()._start_step(step)

    def _finish_step(self, pending) -> None:
        self.log.append(f"finish({pending.step})")
        super()._finish_step(pending)


class RecordingSGD(torch.optim.SGD):
    def __init__(self, params, log: list[str], model):
        super().__init__(params, lr=0.05)
        self.log, self.model = log, model

    def step(self, closure=None):
        self.log.append(f"update({self.model.step_count})")
        return super().step(closure)


def event_log(comm, steps: int, micro_batches: int) -> list[str]:
    log: list[str] = []
    model = wrap(comm, make_mlp(comm.rank), RecordingGossip(log))
    model.module.register_forward_pre_hook(lambda *_: log.append(f"forward({model.step_count})"))
    optimizer = RecordingSGD(model.parameters(), log, model)
    for step in range(steps):
        x, y = batch(comm.rank, step)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            loss_of(model, xs, ys).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.close()
    return log


def test_exchange_of_step_t_starts_before_its_forward_and_mixing_precedes_the_update():
    for log in gossip.simulate(N, event_log, 3, 1):
        assert log[:12] == [
            *("start(0)", "forward(0)", "finish(0)", "update(0)"),
            *("start(1)", "forward(1)", "finish(1)", "update(1)"),
            *("start(2)", "forward(2)", "finish(2)", "update(2)"),
        ]
        assert log[12:] == ["start(3)", "finish(3)"]  # close() completes the exchange started after the last step


def test_micro_batches_share_one_exchange_per_optimizer_step():
    for log in gossip.simulate(N, event_log, 2, 4):
        assert log[:14] == [
            *("start(0)", "forward(0)", "forward(0)", "forward(0)", "forward(0)", "finish(0)", "update(0)"),
            *("start(1)", "forward(1)", "forward(1)", "forward(1)", "forward(1)", "finish(1)", "update(1)"),
        ]


def test_gradient_accumulation_equals_one_big_batch():
    big = gossip.simulate(N, train, 5)
    accumulated = gossip.simulate(N, train, 5, micro_batches=4)
    for rank in range(N):
        torch.testing.assert_close(accumulated[rank]["params"], big[rank]["params"], rtol=1e-5, atol=1e-6)


def test_accum_adam_with_accum_iter_1_equals_adam_under_the_wrapper():
    ours = gossip.simulate(N, train, 6, make_optimizer=lambda p: optim.AccumAdam(p, lr=1e-2, accum_iter=1))
    adam = gossip.simulate(N, train, 6, make_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))
    for rank in range(N):
        torch.testing.assert_close(ours[rank]["params"], adam[rank]["params"], rtol=1e-6, atol=1e-7)


def manual_loop(comm, steps: int) -> torch.Tensor:
    model = wrap(comm, make_mlp(comm.rank))
    for step in range(steps):
        x, y = batch(comm.rank, step)
        loss_of(model, x, y).backward()
        model.finish_mixing()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
                p.grad = None
        model.next_step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    model.close()
    return params


def test_manual_finish_mixing_and_next_step_equal_the_sgd_loop():
    manual = gossip.simulate(N, manual_loop, 4)
    hooked = gossip.simulate(N, train, 4)
    for rank in range(N):
        assert torch.equal(manual[rank], hooked[rank]["params"])


def partial_optimizer(comm) -> None:
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    try:
        loss_of(model, *batch(comm.rank, 0)).backward()
        optimizer.step()
    finally:
        model.close()


def test_optimizer_over_part_of_the_model_is_refused_naming_a_missing_parameter():
    with pytest.raises(ValueError, match=r"rank \d: the optimizer covers only part .* parameter '2.weight'"):
        gossip.simulate(N, partial_optimizer)
