"""The check of the wrapped parameters at the start of every step reads each module's dicts instead of walking the
module tree: what the walk would name differently (a renamed child, parameters in another order, a parameter
slot filled after wrapping) still raises ModelChangedError at the next step, naming the parameter (simulator)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap
from torch import nn

import gossip

N = 2


def _train_after(comm, change: Callable[[nn.Module], None], with_slot: bool) -> None:
    module = make_mlp(comm.rank)
    if with_slot:
        module[0].register_parameter("scale", None)  # an empty slot: named_parameters skips it
    model = wrap(comm, module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_of(model, *batch(comm.rank, 0)).backward()
    optimizer.step()
    optimizer.zero_grad()
    change(model.module)
    loss_of(model, *batch(comm.rank, 1)).backward()  # the step's start finds the change
    optimizer.step()


def _rename_first_child(module: nn.Module) -> None:
    module._modules = {("first" if key == "0" else key): child for key, child in module._modules.items()}


def _swap_weight_and_bias(module: nn.Module) -> None:
    parameters = module[0]._parameters
    weight, bias = parameters.pop("weight"), parameters.pop("bias")
    parameters["bias"], parameters["weight"] = bias, weight


def _fill_the_slot(module: nn.Module) -> None:
    module[0].scale = nn.Parameter(torch.ones(1))


@pytest.mark.parametrize(
    ("change", "with_slot", "expected"),
    [
        (_rename_first_child, False, "found parameter 'first.weight' where '0.weight' was wrapped"),
        (_swap_weight_and_bias, False, "found parameter '0.bias' where '0.weight' was wrapped"),
        (_fill_the_slot, True, "found parameter '0.scale' where '2.weight' was wrapped"),
    ],
    ids=["renamed-child", "reordered", "slot-filled"],
)
def test_a_change_the_walk_would_see_is_named_at_the_next_step(change, with_slot, expected):
    with pytest.raises(Exception) as caught:
        gossip.simulate(N, _train_after, change, with_slot, timeout=20.0)
    message = f"{type(caught.value).__name__}: {caught.value}"
    assert message.startswith("ModelChangedError: rank ") and "step 1" in message and expected in message
