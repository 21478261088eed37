"""MomentumTrackingAdamW's second moment from the tracker (``second_moment="tracker"``; optim/momentum_tracking.py):
alone it is AdamW's; with trackers that hold the exact mean first moment it is DDP's second moment of the mean
gradient, every step; it sends nothing of its own; the two kernels agree bit for bit; the misuses are named (resume:
tests/test_momentum_tracking.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.adam_reference import where_adams_m_squared_exceeds_v
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap
from helpers.tracking_scenarios import tracked_steps, tracker_momentum_tracking_adamw

import gossip
import optim
from gossip.wrapper.momentum import optimizer_kind

N = 4
BETAS = (0.9, 0.95)


_tracker_adamw = tracker_momentum_tracking_adamw


def test_alone_it_is_adamw_but_where_adams_m_squared_exceeds_v():
    """No tracker: z = h, so r = g and u is AdamW's v up to rounding; the update is AdamW's in every coordinate
    where AdamW's bias-corrected m^2 never exceeded v."""
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(64, generator=generator, dtype=torch.float64) + 0.3 for _ in range(40)]
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    optimizer = optim.MomentumTrackingAdamW([weight], lr=1e-2, betas=BETAS, weight_decay=0.1, second_moment="tracker")
    adamw_weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    adamw = torch.optim.AdamW([adamw_weight], lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1)
    for gradient in gradients:
        weight.grad, adamw_weight.grad = gradient.clone(), gradient.clone()
        optimizer.step()
        adamw.step()
    torch.testing.assert_close(optimizer.state[weight]["shared"], adamw.state[adamw_weight]["exp_avg_sq"])
    floored = where_adams_m_squared_exceeds_v(gradients, BETAS)
    assert 0 < floored.sum() < 8
    torch.testing.assert_close(weight.detach()[~floored], adamw_weight.detach()[~floored], rtol=0, atol=1e-12)


def test_with_exact_mean_trackers_it_is_the_mean_gradients_second_moment_every_step():
    """Three ranks whose tracker is the exact mean of their first moments (written by hand): every rank's u is
    DDP's EMA of the mean gradient's square, at every step, and the ranks stay identical."""
    generator = torch.Generator().manual_seed(1)
    weights = [torch.nn.Parameter(torch.zeros(32, dtype=torch.float64)) for _ in range(3)]
    optimizers = [_tracker_adamw([w], weight_decay=0.0) for w in weights]
    expected = torch.zeros(32, dtype=torch.float64)
    for _ in range(25):
        gradients = [torch.randn(32, generator=generator, dtype=torch.float64) for _ in weights]
        for w, g, opt in zip(weights, gradients, optimizers, strict=True):
            w.grad = g.clone()
            opt.prepare_momentum()
        tracker = torch.stack([w.grad for w in weights]).mean(dim=0)
        for w, opt in zip(weights, optimizers, strict=True):
            w.grad = tracker.clone()
            opt.step()
        mean = torch.stack(gradients).mean(dim=0)
        expected.mul_(BETAS[1]).addcmul_(mean, mean, value=1 - BETAS[1])
        for w, opt in zip(weights, optimizers, strict=True):
            torch.testing.assert_close(opt.state[w]["shared"], expected, rtol=1e-12, atol=1e-15)
    assert all(torch.equal(w.detach(), weights[0].detach()) for w in weights)


def _multi_tensor_run(foreach: bool) -> list[torch.Tensor]:
    """Two param groups of float32 tensors, one tensor without a gradient on every other step."""
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((17, 5), (5,), (9, 3), (3,))]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
    optimizer = _tracker_adamw(groups, foreach=foreach)
    for step in range(12):
        for index, p in enumerate(params):
            p.grad = None if index == 3 and step % 2 else torch.randn(p.shape, generator=generator)
        optimizer.prepare_momentum()
        for p in params:  # a tracker that differs from the rank's own first moment
            if p.grad is not None:
                p.grad.add_(torch.randn(p.shape, generator=generator), alpha=0.1)
        optimizer.step()
    states = [optimizer.state[p] for p in params]
    return [p.detach().clone() for p in params] + [st[key] for st in states for key in ("h", "shared", "last")]


def test_the_multi_tensor_path_is_the_per_tensor_loop_bit_for_bit_on_the_cpu():
    looped, batched = _multi_tensor_run(False), _multi_tensor_run(True)
    for index, (a, b) in enumerate(zip(looped, batched, strict=True)):
        assert torch.equal(a, b), index
    assert all(st.abs().sum() > 0 for st in looped[4:])


def test_it_keeps_no_own_second_moment_and_takes_no_samples():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = _tracker_adamw([weight])
    weight.grad = torch.ones(2)
    optimizer.step()
    assert set(optimizer.state[weight]) == {"step", "samples", "h", "shared", "last"}
    assert optimizer.second_moment_every == 0 and not optimizer.mean_gradient_due()
    with pytest.raises(ValueError, match="without samples"):
        optimizer.take_mean_gradient({weight: torch.ones(2)}, workers=2)
    assert optimizer_kind(optimizer) == "MomentumTrackingAdamW(second_moment='tracker')"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"second_moment": "own"}, r"second_moment must be one of \('tracker', 'sample'\), got 'own'"),
        ({"second_moment": "tracker", "second_moment_every": 8}, "takes no samples, got second_moment_every=8"),
    ],
)
def test_bad_settings_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        optim.MomentumTrackingAdamW([torch.nn.Parameter(torch.zeros(2))], **arguments)


def test_sampling_stays_the_default_of_the_optimizer_alone():
    optimizer = optim.MomentumTrackingAdamW([torch.nn.Parameter(torch.zeros(2))])
    assert optimizer.second_moment_every == 32 and not optimizer.tracks_second_moment


@pytest.mark.parametrize(("second_moment", "every", "expected"), [("sample", 64, 64), ("tracker", 64, 0)])
def test_the_pipeline_and_the_optimizer_agree_on_the_sampling_period(second_moment, every, expected):
    pipeline = gossip.Pipeline(second_moment=second_moment, second_moment_every=every)
    assert optim.sampling_every(second_moment, every) == pipeline.sampling_every() == expected
    optimizer = optim.MomentumTrackingAdamW(
        [torch.nn.Parameter(torch.zeros(2))], second_moment=second_moment, second_moment_every=expected
    )
    assert optimizer.second_moment_every == expected


def test_a_sampling_period_for_an_unknown_second_moment_is_refused_by_name():
    with pytest.raises(ValueError, match=r"second_moment must be one of \('tracker', 'sample'\), got 'samples'"):
        optim.sampling_every("samples", 64)


# -- in the wrapper, on the simulator --------------------------------------------------------------------------
def _mean_gradient_check(comm) -> dict:
    """Exact gossip, exact trackers over both dimensions of the hypercube of 4 (every tracker the exact mean), 6
    steps: each step's own gradient and u after the step."""
    model = wrap(comm, make_mlp(comm.rank), gradient_tracking="exact", tracker_hops=2)
    optimizer = _tracker_adamw(model.parameters())
    gradients, seconds = [], []
    try:
        for step in range(6):
            loss_of(model, *batch(comm.rank, step)).backward()
            gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(torch.cat([optimizer.state[p]["shared"].reshape(-1) for p in model.parameters()]).clone())
    finally:
        model.close()
    return {"gradients": gradients, "seconds": seconds}


def test_in_the_wrapper_with_exact_trackers_every_rank_holds_ddps_second_moment():
    results = gossip.simulate(N, _mean_gradient_check)
    expected = torch.zeros_like(results[0]["seconds"][0])
    for step in range(6):
        mean = torch.stack([r["gradients"][step] for r in results]).mean(dim=0)
        expected.mul_(BETAS[1]).addcmul_(mean, mean, value=1 - BETAS[1])
        for rank, result in enumerate(results):
            torch.testing.assert_close(result["seconds"][step], expected, rtol=1e-4, atol=1e-9, msg=f"rank {rank}")


def _own_adamw(parameters) -> optim.MomentumTrackingAdamW:
    return optim.MomentumTrackingAdamW(parameters, lr=1e-2, betas=BETAS, second_moment_every=0)


def _bytes(comm, second_moment: str) -> list[int]:
    factory = _tracker_adamw if second_moment == "tracker" else _own_adamw
    rows = tracked_steps(comm, "exact", True, steps=6, optimizer_factory=factory)
    return [row["bytes_sent"] for row in rows]


def test_it_sends_nothing_beyond_the_parameters_and_the_trackers():
    """The same bytes at every step as momentum tracking with each rank's own second moment (no samples)."""
    assert gossip.simulate(N, _bytes, "tracker") == gossip.simulate(N, _bytes, "own")
