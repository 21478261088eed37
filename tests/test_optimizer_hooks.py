"""gossip.wrapper.optimizer_hooks: one pair of torch.optim global hooks per process, dispatched to the listeners;
``step(None)`` is no closure (Accelerate's optimizer wrapper and ``GradScaler.step`` call a step that way)."""

from __future__ import annotations

import pytest
import torch
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap
from torch.optim import optimizer as torch_optimizer

import gossip
import optim
from gossip.wrapper import optimizer_hooks


class Listener:
    """Claims the optimizers over its parameter; records what the registry calls."""

    def __init__(self, parameter: torch.Tensor, fail_before: bool = False):
        self.parameter, self.fail_before = parameter, fail_before
        self.calls: list[str] = []

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(p is self.parameter for group in optimizer.param_groups for p in group["params"])

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, computes_gradients: bool) -> None:
        self.calls.append(f"before(closure={computes_gradients})")
        if self.fail_before:
            self.fail_before = False
            raise RuntimeError("refused")

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("after")


class NestedSGD(torch.optim.SGD):
    """An optimizer subclass whose step() calls super().step(): torch fires the hooks at both levels."""

    def step(self, closure=None):
        return super().step(closure)


def torch_hook_counts() -> tuple[int, int]:
    return len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks)


@pytest.fixture
def parameters():
    return [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]


def test_one_pair_of_torch_hooks_serves_every_listener_and_goes_with_the_last(parameters):
    before = torch_hook_counts()
    added = 0 if optimizer_hooks._torch_hooks else 1  # installed for wrappers of earlier tests (live or collected)
    listeners = [Listener(p) for p in parameters]
    for listener in listeners:
        optimizer_hooks.subscribe(listener)
    try:
        assert torch_hook_counts() == (before[0] + added, before[1] + added)
        torch.optim.SGD([parameters[1]], lr=0.1).step()
        assert [listener.calls for listener in listeners] == [[], ["before(closure=False)", "after"], []]
    finally:
        for listener in listeners:
            optimizer_hooks.unsubscribe(listener)
    if added:
        assert torch_hook_counts() == before


def test_a_nested_optimizer_step_is_one_step_and_a_closure_is_reported(parameters):
    torch.optim.SGD([parameters[1]], lr=0.1)  # torch hooks SGD.step itself once an SGD exists
    fired: list[str] = []
    counter = torch_optimizer.register_optimizer_step_pre_hook(lambda *_: fired.append("pre"))
    listener = Listener(parameters[0])
    optimizer_hooks.subscribe(listener)
    try:
        optimizer = NestedSGD([parameters[0]], lr=0.1)
        optimizer.step()
        optimizer.step(lambda: torch.tensor(0.0))
    finally:
        optimizer_hooks.unsubscribe(listener)
        counter.remove()
    assert len(fired) == 4  # torch fired the hooks twice per step
    assert listener.calls == ["before(closure=False)", "after", "before(closure=True)", "after"]


def test_a_refused_step_does_not_leave_the_next_one_looking_nested(parameters):
    listener = Listener(parameters[0], fail_before=True)
    optimizer_hooks.subscribe(listener)
    try:
        optimizer = NestedSGD([parameters[0]], lr=0.1)
        with pytest.raises(RuntimeError, match="refused"):
            optimizer.step()  # torch skips the post-hooks: the registry must reset the depth itself
        optimizer.step()
    finally:
        optimizer_hooks.unsubscribe(listener)
    assert listener.calls == ["before(closure=False)", "before(closure=False)", "after"]


def test_none_in_the_closures_place_is_no_closure(parameters):
    """``step(None)`` is how Accelerate's optimizer wrapper and ``GradScaler.step(optimizer, None)`` call a step."""
    listener = Listener(parameters[0])
    optimizer_hooks.subscribe(listener)
    try:
        optimizer = torch.optim.SGD([parameters[0]], lr=0.1)
        optimizer.step(None)
        optimizer.step(closure=None)
        torch.amp.GradScaler("cpu", enabled=False).step(optimizer, None)
        optimizer.step(lambda: torch.tensor(0.0))
    finally:
        optimizer_hooks.unsubscribe(listener)
    assert listener.calls == [
        *["before(closure=False)", "after"] * 3,
        "before(closure=True)",
        "after",
    ]


def _momentum_tracking_step_none(comm) -> str:
    model = wrap(comm, make_mlp(comm.rank), gradient_tracking=True)
    optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, second_moment_every=2)
    try:
        loss_of(model, *batch(comm.rank, 0)).backward()
        optimizer.step(None)  # as AcceleratedOptimizer.step() calls it
        return f"step {model.step_count}"
    finally:
        model.close()


def test_a_momentum_tracking_optimizer_stepped_with_none_is_accepted():
    assert gossip.simulate(2, _momentum_tracking_step_none) == ["step 1", "step 1"]
