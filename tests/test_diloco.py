"""DiLoCo (gossip.DiLoCo): its outer step against torch's SGD, the paper's update written out and torchft's DiLoCo;
its synchronisations on the simulator (identical replicas, bytes on synchronisation steps only, the exact average
as a special case); bit-identical resume; and its refusals."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers.outer_scenarios import SHAPES, local_buckets, nan_replica_message, outer_resume
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap

import gossip
import topologies
from gossip.algorithms.base import COLLECTIVE
from gossip.algorithms.diloco import DiLoCo, outer_step
from gossip.backends.base import ring_all_reduce_bytes
from gossip.errors import CheckpointError

N = 4


def tensors(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in SHAPES]


# -- the outer step -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.9, False), (0.0, False)])
def test_the_outer_step_is_torch_sgds_bit_for_bit(momentum, nesterov):
    """Three outer steps on the same pseudo-gradients: outer_step performs torch.optim.SGD's single-tensor update
    (the one torch runs on CPU tensors) operation for operation, so the bits agree."""
    theta, buffers = tensors(0), [torch.zeros(shape) for shape in SHAPES]
    reference = [torch.nn.Parameter(t.clone()) for t in theta]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=momentum, nesterov=nesterov, foreach=False)
    for step in range(3):
        delta = tensors(10 + step)
        outer_step(theta, buffers, delta, lr=0.7, momentum=momentum, nesterov=nesterov, first=step == 0)
        for parameter, d in zip(reference, delta, strict=True):
            parameter.grad = d.clone()
        sgd.step()
        for mine, theirs in zip(theta, reference, strict=True):
            assert torch.equal(mine, theirs.detach()), f"outer step {step}"


def test_the_outer_step_is_the_papers_nesterov_update_written_out():
    """v <- mu v + Delta; theta <- theta - lr (Delta + mu v) (DiLoCo, Algorithm 1, with SGD-Nesterov as OuterOpt),
    written out with plain products and sums in float64. outer_step's ``add(..., alpha=)`` may fuse a product and
    a sum into one rounding where the written-out form rounds twice, so the two agree to float64 rounding (values
    of order 1: 1e-14 absolute is a few ulps), not bit for bit."""
    lr, mu = 0.7, 0.9
    theta, buffers = tensors(0, torch.float64), [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    written = [t.clone() for t in theta]
    velocity = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    for step in range(4):
        delta = tensors(10 + step, torch.float64)
        outer_step(theta, buffers, delta, lr=lr, momentum=mu, nesterov=True, first=step == 0)
        for i, d in enumerate(delta):
            velocity[i] = mu * velocity[i] + d
            written[i] = written[i] - lr * (d + mu * velocity[i])
        for mine, paper in zip(theta, written, strict=True):
            torch.testing.assert_close(mine, paper, rtol=0, atol=1e-14)


def test_the_outer_step_equals_torchfts_diloco_on_identical_pseudo_gradients():
    """torchft.local_sgd.DiLoCo (Meta's implementation) with a stand-in manager whose all-reduce returns the given
    mean pseudo-gradient: after each synchronisation its model holds the theta that gossip.DiLoCo's outer step
    computes from the same mean pseudo-gradient, bit for bit (both run torch's SGD update; torchft restores the
    synchronised parameters, takes their difference to the local ones as the gradient and steps)."""
    pytest.importorskip("torchft.local_sgd", reason="torchft is a test extra (pip install torchft)")
    from unittest.mock import create_autospec

    from torchft.local_sgd import DiLoCo as TorchftDiLoCo
    from torchft.manager import Manager
    from torchft.work import _DummyWork

    model = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in tensors(0)])
    theta, buffers = tensors(0), [torch.zeros(shape) for shape in SHAPES]
    means: list[torch.Tensor] = []  # the mean pseudo-gradients the stand-in all-reduce hands out, in order

    def all_reduce(tensor: torch.Tensor, should_quantize: bool = False) -> _DummyWork:
        tensor.copy_(means.pop(0))
        return _DummyWork(tensor)

    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.errored.return_value = None
    manager.should_commit.return_value = True
    manager.current_step.return_value = 0
    manager.allreduce.side_effect = all_reduce
    inner = torch.optim.SGD(model.parameters(), lr=0.0)  # the local steps are set by hand below
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with TorchftDiLoCo(manager, [model], inner, outer, sync_every=1):
        for step in range(3):
            local = tensors(20 + step)
            with torch.no_grad():
                for parameter, x in zip(model, local, strict=True):
                    parameter.copy_(x)  # this worker's parameters after its local steps
            mean = tensors(10 + step)
            means.extend(m.clone() for m in mean)
            inner.step()  # torchft synchronises in the optimizer's post-step hook
            outer_step(theta, buffers, mean, lr=0.7, momentum=0.9, nesterov=True, first=step == 0)
            for mine, theirs in zip(theta, model, strict=True):
                assert torch.equal(mine, theirs.detach()), f"synchronisation {step}"
    assert not means


# -- on the simulator, without the wrapper ----------------------------------------------------------------------
def two_synchronisations(comm) -> dict:
    buckets = local_buckets(comm.rank)
    before = [b.buffer.clone() for b in buckets]
    algorithm = DiLoCo(local_steps=2, outer_lr=0.7, outer_momentum=0.9)
    algorithm.setup(comm, None, buckets)
    replicas, thetas = [], []
    for step in range(4):
        algorithm.step(step)
        replicas.append([b.buffer.clone() for b in buckets])
        thetas.append([t.clone() for t in algorithm.synchronised()])
        if step == 1:  # a local update between the two synchronisations
            for b in buckets:
                b.buffer.add_(0.01 * (comm.rank + 1))
    return {"before": before, "replicas": replicas, "thetas": thetas}


def test_a_synchronisation_applies_the_outer_step_to_rank_0s_parameters_with_the_mean_pseudo_gradient():
    """Synchronisations at steps 1 and 3 ((t + 1) % H == 0 with H = 2): theta starts as rank 0's parameters,
    Delta = theta - mean_i x_i, and the outer step is Nesterov SGD, written out here in float64 (equal to
    rounding: the all-reduce sums in its own order). Every replica is theta after a synchronisation, its own
    before the first."""
    results = gossip.simulate(N, two_synchronisations)
    replicas = [torch.stack([r["before"][i] for r in results]) for i in range(len(SHAPES))]
    theta = [r[0].clone() for r in replicas]
    velocity = [torch.zeros_like(t) for t in theta]
    for _ in range(2):
        for i in range(len(theta)):
            delta = (theta[i] - replicas[i]).mean(dim=0)
            velocity[i] = 0.9 * velocity[i] + delta
            theta[i] = theta[i] - 0.7 * (delta + 0.9 * velocity[i])
        replicas = [torch.stack([theta[i] + 0.01 * (rank + 1) for rank in range(N)]) for i in range(len(theta))]
    for result in results:
        for mine, expected in zip(result["thetas"][3], theta, strict=True):
            torch.testing.assert_close(mine, expected, rtol=0, atol=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(result["replicas"][0], result["before"], strict=True))
        for step in (1, 3):
            assert all(torch.equal(a, b) for a, b in zip(result["replicas"][step], result["thetas"][step], strict=True))
            assert all(
                torch.equal(a, b) for a, b in zip(result["thetas"][step], results[0]["thetas"][step], strict=True)
            )


# -- inside the wrapper ---------------------------------------------------------------------------------------
def train(comm, algorithm: gossip.Algorithm, steps: int, dtype: torch.dtype = torch.float32) -> dict:
    """``steps`` SGD steps of the regression MLP in the wrapper; after each step's mixing (before the update):
    the bytes the step sent, and on synchronisation steps every rank's replica and theta."""
    model = wrap(comm, make_mlp(comm.rank).to(dtype), algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    sent, synced = [], {}
    for step in range(steps):
        x, y = batch(comm.rank, step)
        loss_of(model, x.to(dtype), y.to(dtype)).backward()
        model.finish_mixing()
        sent.append(dict(algorithm.traffic.last_sent))
        if isinstance(algorithm, DiLoCo) and algorithm.period.ends(step):
            replica = torch.cat([b.buffer for b in model.buckets]).clone()
            synced[step] = (comm.all_gather_object(replica), torch.cat(algorithm.synchronised()).clone())
        optimizer.step()
        optimizer.zero_grad()
    final = torch.cat([b.buffer for b in model.buckets]).clone()
    model.close()
    return {"sent": sent, "synced": synced, "final": final, "model_bytes": sum(b.nbytes for b in model.buckets)}


def test_after_every_synchronisation_all_replicas_are_theta_bit_for_bit_and_only_those_steps_send():
    results = gossip.simulate(N, lambda comm: train(comm, DiLoCo(local_steps=3), 9))
    for rank, result in enumerate(results):
        assert sorted(result["synced"]) == [2, 5, 8]
        for step, (replicas, theta) in result["synced"].items():
            for other, replica in enumerate(replicas):
                assert torch.equal(replica, theta), f"rank {rank} step {step}: rank {other}'s replica is not theta"
        for step, sent in enumerate(result["sent"]):
            if step in (2, 5, 8):
                assert sent == {COLLECTIVE: ring_all_reduce_bytes(result["model_bytes"], N)}, f"step {step}"
            else:
                assert sent == {}, f"rank {rank} step {step}: sent {sent} between synchronisations"
    theta_everywhere = [result["synced"][8][1] for result in results]
    assert all(torch.equal(theta, theta_everywhere[0]) for theta in theta_everywhere)


def test_one_local_step_with_outer_lr_1_and_no_momentum_is_the_exact_average_every_step():
    """H = 1, lr 1, mu 0: theta <- theta - (theta - mean_i x_i) = mean_i x_i, i.e. AllReduce (and
    PeriodicAverage(every=1)). Equal to rounding (theta - (theta - xbar) is xbar up to one float64 rounding per
    step), in float64."""
    diloco = gossip.simulate(N, lambda comm: train(comm, DiLoCo(1, outer_lr=1.0, outer_momentum=0.0), 6, torch.float64))
    exact = gossip.simulate(N, lambda comm: train(comm, gossip.AllReduce(), 6, torch.float64))
    for rank in range(N):
        torch.testing.assert_close(diloco[rank]["final"], exact[rank]["final"], rtol=0, atol=1e-13)
        assert diloco[rank]["sent"] == exact[rank]["sent"]  # the same all-reduce, every step


def test_a_run_resumed_in_the_middle_of_a_period_is_bit_identical(tmp_path):
    """Saved at step 4 (H = 3: one outer step behind it at step 2, the next at 5): the parameters, theta, the outer
    momentum and the outer step count after 9 steps are those of the uninterrupted run, bit for bit."""
    for rank, result in enumerate(gossip.simulate(N, outer_resume, tmp_path, lambda: DiLoCo(local_steps=3), 9, 4)):
        assert result["resumed_at"] == 4
        (params, state), (resumed_params, resumed_state) = result["uninterrupted"], result["resumed"]
        assert torch.equal(params, resumed_params), f"rank {rank}"
        assert state["outer_steps"] == resumed_state["outer_steps"] == 3
        for key in ("sync", "momentum"):
            assert all(torch.equal(a, b) for a, b in zip(state[key], resumed_state[key], strict=True)), (rank, key)


def load_another_ranks_state(comm) -> str:
    buckets = local_buckets(comm.rank)
    algorithm = DiLoCo(local_steps=2)
    algorithm.setup(comm, None, buckets)
    algorithm.step(0)
    algorithm.step(1)
    state = algorithm.state_dict()
    if comm.rank == 2:
        state["momentum"][0].add_(1.0)  # e.g. a file of another save
    algorithm.load_state_dict(state)
    try:
        algorithm.step(2)
    except CheckpointError as error:
        return str(error)
    return "accepted"


def test_a_state_that_differs_between_ranks_is_refused_at_the_next_step_on_every_rank():
    for rank, message in enumerate(gossip.simulate(N, load_another_ranks_state)):
        assert message.startswith(f"rank {rank}: step 2: rank 2's DiLoCo state") and "differs from rank 0's" in message


def test_a_replica_holding_nan_at_a_synchronisation_is_named_on_every_rank():
    for rank, message in enumerate(gossip.simulate(N, nan_replica_message, lambda: DiLoCo(local_steps=1))):
        assert message.startswith(f"rank {rank}: step 0: DiLoCo's mean pseudo-gradient is non-finite")
        assert "ranks [1]" in message


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"local_steps": 0}, "local_steps must be an integer >= 1"),
        ({"local_steps": True}, "local_steps must be an integer >= 1"),
        ({"outer_lr": 0.0}, "outer_lr must be a positive finite number"),
        ({"outer_lr": math.inf}, "outer_lr must be a positive finite number"),
        ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
        ({"nesterov": 1}, "nesterov must be True or False"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(kwargs, says):
    with pytest.raises(ValueError, match=re.escape(f"DiLoCo: {says}")):
        DiLoCo(**kwargs)


def test_its_config_is_its_four_settings_and_a_state_of_another_config_is_refused():
    assert DiLoCo().config() == {"local_steps": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}

    def reload(comm) -> str:
        algorithm = DiLoCo(local_steps=4)
        algorithm.setup(comm, topologies.ring(comm.size), local_buckets(comm.rank))
        other = DiLoCo(local_steps=5)
        other.setup(comm, topologies.ring(comm.size), local_buckets(comm.rank))
        with pytest.raises(ValueError, match=r"saved with .*'local_steps': 4.*this run uses .*'local_steps': 5"):
            other.load_state_dict(algorithm.state_dict())
        return "refused"

    assert gossip.simulate(2, reload) == ["refused"] * 2
