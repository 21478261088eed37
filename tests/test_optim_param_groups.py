"""optim.param_groups: decay on matrices, none on biases / normalisation (docs/design.md B.1 bug to avoid)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import optim


def small_network() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2), nn.LayerNorm(2))


def test_one_dimensional_tensors_go_to_the_no_decay_group():
    _, no_decay = optim.param_groups(small_network(), weight_decay=0.1)
    assert no_decay["weight_decay"] == 0.0
    assert no_decay["params"] and all(p.ndim <= 1 for p in no_decay["params"])


def test_matrices_and_kernels_go_to_the_decay_group():
    decay, _ = optim.param_groups(small_network(), weight_decay=0.1)
    assert decay["weight_decay"] == 0.1
    assert decay["params"] and all(p.ndim >= 2 for p in decay["params"])


def test_every_trainable_parameter_is_in_exactly_one_group():
    network = small_network()
    network[3].bias.requires_grad_(False)
    groups = optim.param_groups(network, weight_decay=0.1)
    grouped = [id(p) for group in groups for p in group["params"]]
    trainable = [id(p) for p in network.parameters() if p.requires_grad]
    assert sorted(grouped) == sorted(trainable)


def test_groups_plug_into_torch_and_accum_optimizers():
    network = small_network()
    for optimizer_class in (optim.SGD, optim.AccumAdamW):
        optimizer = optimizer_class(optim.param_groups(network, weight_decay=0.1), lr=0.1)
        assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]


def test_negative_weight_decay_is_refused():
    with pytest.raises(ValueError, match="weight_decay"):
        optim.param_groups(small_network(), weight_decay=-1.0)


def test_sgd_is_torch_sgd_itself():
    assert optim.SGD is torch.optim.SGD
