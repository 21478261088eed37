"""Bad optimizer arguments are refused at construction with a message naming the argument."""

from __future__ import annotations

import pytest
import torch

import optim

BAD_ARGUMENTS = [
    ({"accum_iter": 0}, "accum_iter"),
    ({"accum_iter": -2}, "accum_iter"),
    ({"accum_iter": 2.5}, "accum_iter"),
    ({"accum_iter": 4.0}, "accum_iter"),
    ({"accum_iter": True}, "accum_iter"),
    ({"accum_iter": "4"}, "accum_iter"),
    ({"lr": -1e-3}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"lr": torch.tensor(1e-3)}, "lr"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"betas": (1.0, 0.999)}, r"betas\[0\]"),
    ({"betas": (-0.1, 0.999)}, r"betas\[0\]"),
    ({"betas": (0.9, 1.0)}, r"betas\[1\]"),
    ({"betas": (0.9,)}, "betas"),
]


def fresh_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("variant", [optim.AccumAdam, optim.AccumAdamW])
@pytest.mark.parametrize(("arguments", "named"), BAD_ARGUMENTS)
def test_invalid_argument_raises_naming_it(variant, arguments, named):
    with pytest.raises(ValueError, match=named):
        variant(fresh_params(), **arguments)


def test_invalid_per_group_override_raises_naming_the_group():
    groups = [{"params": fresh_params()}, {"params": fresh_params(), "accum_iter": 0}]
    with pytest.raises(ValueError, match=r"param group 1: accum_iter"):
        optim.AccumAdam(groups)


def test_invalid_group_added_later_is_not_kept():
    optimizer = optim.AccumAdam(fresh_params())
    with pytest.raises(ValueError, match="lr"):
        optimizer.add_param_group({"params": fresh_params(), "lr": -1.0})
    assert len(optimizer.param_groups) == 1


def test_boundary_values_are_accepted():
    optimizer = optim.AccumAdamW(fresh_params(), lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0, accum_iter=1)
    assert optimizer.param_groups[0]["accum_iter"] == 1


def test_adamw_default_weight_decay_matches_torch():
    torch_default = torch.optim.AdamW(fresh_params()).defaults["weight_decay"]
    assert optim.AccumAdamW(fresh_params()).defaults["weight_decay"] == torch_default
