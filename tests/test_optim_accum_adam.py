"""AccumAdam / AccumAdamW: the update rule of docs/design.md B.3, pinned property by property."""

from __future__ import annotations

import io
import math

import pytest
import torch

import optim

SHAPES = [(7, 5), (5,), (), (3, 2, 2, 2)]
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def make_params(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype)) for shape in SHAPES]


def gradient_sequence(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params] for _ in range(steps)]


def apply(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    optimizer.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize(
    ("ours", "theirs"), [(optim.AccumAdam, torch.optim.Adam), (optim.AccumAdamW, torch.optim.AdamW)]
)
def test_accum_iter_one_equals_torch_adam(ours, theirs, dtype, weight_decay, maximize):
    params_ours, params_torch = make_params(dtype), make_params(dtype)
    opt_ours = ours(params_ours, lr=1e-2, weight_decay=weight_decay, accum_iter=1, maximize=maximize)
    opt_torch = theirs(params_torch, lr=1e-2, weight_decay=weight_decay, maximize=maximize)
    for grads in gradient_sequence(params_ours, steps=50):
        apply(opt_ours, params_ours, grads)
        apply(opt_torch, params_torch, grads)
    tolerance = {torch.float32: 1e-6, torch.float64: 1e-13}[dtype]
    for mine, reference in zip(params_ours, params_torch, strict=True):
        torch.testing.assert_close(mine, reference, rtol=tolerance, atol=tolerance)


def test_moments_commit_only_every_accum_iter_steps_with_mean_gradient():
    accum_iter = 4
    params = make_params()
    optimizer = optim.AccumAdam(params, lr=1e-2, accum_iter=accum_iter)
    sequence = gradient_sequence(params, steps=3 * accum_iter)
    committed_m = [torch.zeros_like(p) for p in params]
    committed_v = [torch.zeros_like(p) for p in params]
    for k, grads in enumerate(sequence, start=1):
        apply(optimizer, params, grads)
        if k % accum_iter == 0:
            window = sequence[k - accum_iter : k]
            for i in range(len(params)):
                mean = torch.stack([step_grads[i] for step_grads in window]).mean(0)
                committed_m[i] = BETA1 * (committed_m[i] + (1 - BETA1) * mean)
                committed_v[i] = BETA2 * (committed_v[i] + (1 - BETA2) * mean * mean)
        for i, param in enumerate(params):
            state = optimizer.state[param]
            torch.testing.assert_close(state["beta1_exp_avg"], committed_m[i], rtol=1e-13, atol=1e-15)
            torch.testing.assert_close(state["beta2_exp_avg_sq"], committed_v[i], rtol=1e-13, atol=1e-15)


def test_l2_weight_decay_enters_the_accumulator():
    param = torch.nn.Parameter(torch.tensor([2.0, -1.0], dtype=torch.float64))
    optimizer = optim.AccumAdam([param], lr=1e-2, weight_decay=0.5, accum_iter=4)
    before = param.detach().clone()
    param.grad = torch.tensor([0.3, 0.7], dtype=torch.float64)
    optimizer.step()
    expected = (param.grad + 0.5 * before) / 4
    torch.testing.assert_close(optimizer.state[param]["grad_accum"], expected, rtol=1e-15, atol=0)


def test_decoupled_weight_decay_stays_out_of_the_accumulator():
    param = torch.nn.Parameter(torch.tensor([2.0, -1.0], dtype=torch.float64))
    optimizer = optim.AccumAdamW([param], lr=1e-2, weight_decay=0.5, accum_iter=4)
    param.grad = torch.tensor([0.3, 0.7], dtype=torch.float64)
    optimizer.step()
    torch.testing.assert_close(optimizer.state[param]["grad_accum"], param.grad / 4, rtol=1e-15, atol=0)


@pytest.mark.parametrize("variant", [optim.AccumAdam, optim.AccumAdamW])
def test_parameters_change_on_every_step(variant):
    params = make_params()
    optimizer = variant(params, lr=1e-3, accum_iter=4)
    for grads in gradient_sequence(params, steps=9):
        before = [p.detach().clone() for p in params]
        apply(optimizer, params, grads)
        for old, new in zip(before, params, strict=True):
            assert not torch.equal(old, new)


def test_bias_correction_uses_ceil_of_step_over_accum_iter():
    accum_iter, lr, target_step = 3, 1e-2, 4  # tau = ceil(4/3) = 2, unlike k = 4 or floor(4/3) = 1
    params = make_params()
    optimizer = optim.AccumAdam(params, lr=lr, accum_iter=accum_iter)
    sequence = gradient_sequence(params, steps=target_step)
    for grads in sequence[:-1]:
        apply(optimizer, params, grads)
    param, grad = params[0], sequence[-1][0]
    state = optimizer.state[param]
    m, v, x = state["beta1_exp_avg"].clone(), state["beta2_exp_avg_sq"].clone(), param.detach().clone()

    def predicted(tau: int) -> torch.Tensor:
        m_tilde, v_tilde = m + (1 - BETA1) * grad, v + (1 - BETA2) * grad**2
        return x - lr / (1 - BETA1**tau) * m_tilde / (v_tilde.sqrt() / math.sqrt(1 - BETA2**tau) + EPS)

    apply(optimizer, params, sequence[-1])
    torch.testing.assert_close(param.detach(), predicted(tau=2), rtol=1e-14, atol=1e-15)
    for wrong_tau in (1, target_step):
        assert not torch.allclose(param.detach(), predicted(wrong_tau), rtol=1e-8, atol=0)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        inputs = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("variant", [optim.AccumAdam, optim.AccumAdamW])
def test_resume_mid_window_from_state_dict_is_bit_identical(variant):
    settings = {"lr": 1e-2, "weight_decay": 0.05, "accum_iter": 4}
    model = make_model()
    optimizer = variant(optim.param_groups(model, weight_decay=0.05), **settings)
    train(model, optimizer, range(0, 6))  # 6 = one full window of 4 plus 2 steps into the next
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    train(model, optimizer, range(6, 13))

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed_model = make_model()
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = variant(optim.param_groups(resumed_model, weight_decay=0.05), **settings)
    resumed.load_state_dict(checkpoint["optimizer"])
    train(resumed_model, resumed, range(6, 13))

    for original, restored in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(original, restored)
        for key, value in optimizer.state[original].items():
            assert torch.equal(value, resumed.state[restored][key]), key


@pytest.mark.parametrize("variant", [optim.AccumAdam, optim.AccumAdamW])
@pytest.mark.parametrize("maximize", [False, True])
def test_foreach_path_is_bit_identical_to_per_tensor_path(variant, maximize):
    runs = []
    for foreach in (False, True):
        params = make_params(torch.float32) + make_params(torch.float64, seed=3)
        optimizer = variant(params, lr=1e-2, weight_decay=0.1, accum_iter=3, maximize=maximize, foreach=foreach)
        for step, grads in enumerate(gradient_sequence(params, steps=11)):
            apply(optimizer, params, grads)
            if step % 4 == 1:  # a param without grad pauses its own window, desynchronising the counters
                params[1].grad = None
                optimizer.step()
        runs.append((params, optimizer))
    (params_a, opt_a), (params_b, opt_b) = runs
    for param_a, param_b in zip(params_a, params_b, strict=True):
        assert torch.equal(param_a, param_b)
        for key, value in opt_a.state[param_a].items():
            assert torch.equal(value, opt_b.state[param_b][key]), key


def test_params_without_grad_are_skipped():
    params = make_params()
    optimizer = optim.AccumAdamW(params, lr=1e-2)
    frozen = params[2].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    assert torch.equal(params[2], frozen)
    assert len(optimizer.state[params[2]]) == 0


def test_one_optimizer_over_stacked_rows_equals_independent_optimizers():
    rows, dim, accum_iter = 4, 9, 3
    generator = torch.Generator().manual_seed(0)
    stacked = torch.nn.Parameter(torch.randn(rows, dim, generator=generator, dtype=torch.float64))
    separate = [torch.nn.Parameter(stacked.detach()[r].clone()) for r in range(rows)]
    opt_stacked = optim.AccumAdam([stacked], lr=1e-2, accum_iter=accum_iter)
    opt_separate = [optim.AccumAdam([p], lr=1e-2, accum_iter=accum_iter) for p in separate]
    for _ in range(10):
        grad = torch.randn(rows, dim, generator=generator, dtype=torch.float64)
        stacked.grad = grad
        opt_stacked.step()
        for r, (param, optimizer) in enumerate(zip(separate, opt_separate, strict=True)):
            param.grad = grad[r].clone()
            optimizer.step()
    assert torch.equal(stacked.detach(), torch.stack([p.detach() for p in separate]))


def test_complex_parameters_match_torch_adam():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4, 3, dtype=torch.complex128, generator=generator)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_ours, opt_torch = optim.AccumAdam([ours], accum_iter=1), torch.optim.Adam([theirs])
    for _ in range(20):
        grad = torch.randn(4, 3, dtype=torch.complex128, generator=generator)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_torch.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-13)


def test_step_returns_the_closure_loss():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = optim.AccumAdam([param])

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = param.square().sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.item() == 5.0
    assert not torch.equal(param.detach(), torch.tensor([1.0, 2.0]))


def test_sparse_gradient_is_refused_naming_the_parameter():
    param = torch.nn.Parameter(torch.zeros(4, 2))
    optimizer = optim.AccumAdam([torch.nn.Parameter(torch.zeros(1)), param])
    param.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(ValueError, match=r"sparse gradients \(param group 0, parameter 1, shape \(4, 2\)\)"):
        optimizer.step()
