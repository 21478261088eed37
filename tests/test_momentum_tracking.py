"""Momentum tracking (optim.MomentumTrackingAdamW with ``gradient_tracking``; gossip/wrapper/momentum.py): the
optimizer alone, then on the simulator: the trackers' sum is the sum of the ranks' first moments at every step, the
sampled second moment is the mean gradient's (all-reduced, or gossiped over the schedule's exact hops), its bytes
are booked, the ranks must agree on the optimizer (compared with their peers), the misuses are named, and resume is
bit-identical. The same scenarios on Gloo and MPI against the simulator:
test_gradient_tracking_powergossip.py ("momentum" cases)."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from helpers.adam_reference import where_adams_m_squared_exceeds_v
from helpers.parallel_scenarios import batch, checkpoint_resume, loss_of, make_mlp, wrap
from helpers.tracking_scenarios import (
    assert_trackers_sum_to_the_gradients,
    momentum_tracking_adamw,
    tracked_steps,
    tracker_momentum_tracking_adamw,
)

import gossip
import optim
import topologies
from gossip.backends.base import ring_all_reduce_bytes
from gossip.errors import (
    GossipError,
    InvalidArgumentError,
    StepPhaseError,
)
from gossip.wrapper.peer_agreement import MESSAGE_BYTES

N = 4
BETAS = (0.9, 0.95)


def _adamw_trajectory(gradients: list[torch.Tensor]) -> torch.Tensor:
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    adamw = torch.optim.AdamW([weight], lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1)
    for gradient in gradients:
        weight.grad = gradient.clone()
        adamw.step()
    return weight.detach()


def test_alone_with_its_own_second_moment_it_is_adamw_but_where_adams_m_squared_exceeds_v():
    """No tracker: z = h, the rank's own first moment; with its own v the update is AdamW's in every coordinate
    where AdamW's bias-corrected m^2 never exceeded v, and step() prepares the first moment itself."""
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(64, generator=generator, dtype=torch.float64) + 0.3 for _ in range(40)]
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    optimizer = optim.MomentumTrackingAdamW([weight], lr=1e-2, betas=BETAS, weight_decay=0.1, second_moment_every=0)
    for gradient in gradients:
        weight.grad = gradient.clone()
        optimizer.step()
    adamw, floored = _adamw_trajectory(gradients), where_adams_m_squared_exceeds_v(gradients, BETAS)
    assert 0 < floored.sum() < 8  # the case occurs, in a few coordinates
    torch.testing.assert_close(weight.detach()[~floored], adamw[~floored], rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.detach()[floored], adamw[floored], rtol=0, atol=1e-4)


def test_no_coordinate_moves_more_than_lr_where_the_own_second_moment_is_zero():
    """A coordinate this rank's batches never touch has v_i = 0 while the tracker carries the others' first
    moments: the z^2 floor bounds its step by lr (without it: about z / eps)."""
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    optimizer = optim.MomentumTrackingAdamW([weight], lr=1e-3, betas=BETAS, weight_decay=0.0, second_moment_every=0)
    for _ in range(3):
        weight.grad = torch.zeros(4, dtype=torch.float64)
        optimizer.prepare_momentum()
        weight.grad = torch.full((4,), 0.05, dtype=torch.float64)  # the tracker: the other ranks' first moments
        before = weight.detach().clone()
        optimizer.step()
        assert (weight.detach() - before).abs().max().item() == pytest.approx(1e-3, rel=1e-6)


def test_the_mean_gradient_is_due_every_k_steps_from_the_first_and_its_square_is_the_second_moment():
    weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = optim.MomentumTrackingAdamW([weight], lr=0.0, betas=BETAS, second_moment_every=3)
    due = []
    for _ in range(7):
        due.append(optimizer.mean_gradient_due())
        if due[-1]:
            optimizer.take_mean_gradient({weight: torch.full((3,), 2.0, dtype=torch.float64)}, workers=4)
        weight.grad = torch.ones(3, dtype=torch.float64)
        optimizer.step()
    assert due == [True, False, False, True, False, False, True]
    state, group = optimizer.state[weight], optimizer.param_groups[0]
    assert state["samples"] == 3 and group["workers"] == 4 and group["tracking_step"] == 7
    # u over 3 samples of 2^2, bias-corrected: exactly 4 (above the floor v_i / n = 1 / 4)
    torch.testing.assert_close(optimizer.second_moment(group, state), torch.full((3,), 4.0, dtype=torch.float64))


def _multi_tensor_run(foreach: bool) -> list[torch.Tensor]:
    """Two param groups of float32 tensors, the mean gradient every 3 steps, one tensor without a gradient on
    every other step (its step count falls behind, its sample count too)."""
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((17, 5), (5,), (9, 3), (3,))]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
    optimizer = optim.MomentumTrackingAdamW(groups, lr=1e-2, betas=BETAS, second_moment_every=3, foreach=foreach)
    for step in range(12):
        for index, p in enumerate(params):
            p.grad = None if index == 3 and step % 2 else torch.randn(p.shape, generator=generator)
        if optimizer.mean_gradient_due():
            means = {p: torch.randn(p.shape, generator=generator) for p in params if p.grad is not None}
            optimizer.take_mean_gradient(means, workers=4)
        optimizer.step()
    states = [optimizer.state[p] for p in params]
    return [p.detach().clone() for p in params] + [st[key] for st in states for key in ("h", "v", "shared")]


def test_the_multi_tensor_path_is_the_per_tensor_loop_bit_for_bit_on_the_cpu():
    """foreach=True runs torch._foreach_* kernels per group (what CUDA parameters get by default): on the CPU the
    same parameters and moments as the per-tensor loop, bit for bit."""
    assert optim.MomentumTrackingAdamW([torch.nn.Parameter(torch.zeros(2))]).param_groups[0]["foreach"] is None
    looped, batched = _multi_tensor_run(False), _multi_tensor_run(True)
    for index, (a, b) in enumerate(zip(looped, batched, strict=True)):
        assert torch.equal(a, b), index
    assert all(st.abs().sum() > 0 for st in looped[4:])  # every moment moved, the sampled one included


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"second_moment_every": -1}, "second_moment_every must be an integer >= 0"),
        ({"second_moment_every": True}, "second_moment_every must be an integer >= 0"),
        ({"lr": -1.0}, "lr must be a finite float >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] must lie in \[0, 1\)"),
    ],
)
def test_bad_hyper_parameters_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        optim.MomentumTrackingAdamW([torch.nn.Parameter(torch.zeros(2))], **arguments)


def test_a_sample_without_sampling_is_refused():
    optimizer = optim.MomentumTrackingAdamW([torch.nn.Parameter(torch.zeros(2))], second_moment_every=0)
    assert not optimizer.mean_gradient_due()
    with pytest.raises(ValueError, match="second_moment_every=0"):
        optimizer.take_mean_gradient({}, workers=2)


# -- in the wrapper, on the simulator --------------------------------------------------------------------------
def _momentum_steps(comm) -> list[dict]:
    """Six steps of exact gossip and exact trackers, the mean gradient sampled every 2 steps."""
    return tracked_steps(comm, "exact", True, steps=6, optimizer_factory=momentum_tracking_adamw)


def test_the_trackers_sum_is_the_sum_of_the_ranks_first_moments_at_every_step():
    per_rank = gossip.simulate(N, _momentum_steps)
    assert_trackers_sum_to_the_gradients(per_rank)  # "g": what the tracker tracked, and .grad is the tracker
    for rank, rows in enumerate(per_rank):
        for step, row in enumerate(rows):  # what it tracked is the optimizer's first moment, bit for bit
            assert torch.equal(row["g"], row["h"]), f"rank {rank} step {step}"
            assert row["h"].abs().max() > 0
    assert not torch.equal(per_rank[0][-1]["y"], per_rank[0][-1]["h"])  # and mixing changed it


def test_the_overlapped_tracker_carries_the_first_moments_too():
    """tracking_overlap=True (combine-then-adapt: the previous trackers travel during forward and backward) with a
    momentum source: the same sum invariant over the first moments, and what it tracks is the optimizer's h."""
    per_rank = gossip.simulate(
        N, lambda comm: tracked_steps(comm, "exact", True, 6, True, optimizer_factory=momentum_tracking_adamw)
    )
    assert_trackers_sum_to_the_gradients(per_rank)
    for rows in per_rank:
        assert all(torch.equal(row["g"], row["h"]) for row in rows)


def _sampled_second_moment(comm, mean_gradient: str, schedule: str, steps: int, dtype: torch.dtype | None) -> dict:
    """``steps`` steps at lr 0 (the model stays put); step 0's gradient, after each step the optimizer's sample
    count, and at the end u and the mean it was handed (flat, in the parameters' order)."""
    model = gossip.DecentralizedDataParallel(
        make_mlp(comm.rank),
        comm,
        topologies.by_name(schedule, comm.size),
        gossip.ExactGossip(),
        gradient_tracking=True,
        mean_gradient=mean_gradient,
        mean_gradient_dtype=dtype,
    )
    optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=0.0, betas=BETAS, second_moment_every=16)
    handed: list[torch.Tensor] = []
    take = optimizer.take_mean_gradient

    def recording(means, workers):
        handed.append(torch.cat([means[p].reshape(-1) for p in model.parameters()]).clone())
        take(means, workers)

    optimizer.take_mean_gradient = recording
    first = next(iter(model.parameters()))
    samples = []
    for step in range(steps):
        loss_of(model, *batch(comm.rank, step)).backward()
        if step == 0:
            gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        optimizer.step()
        optimizer.zero_grad()
        samples.append(optimizer.state[first]["samples"])
    shared = torch.cat([optimizer.state[p]["shared"].reshape(-1) for p in model.parameters()]).clone()
    workers = optimizer.param_groups[0]["workers"]
    model.close()
    return {"gradient": gradient, "shared": shared, "workers": workers, "samples": samples, "handed": handed}


def _rounded_gossip(gradients: list[torch.Tensor], schedule: topologies.Schedule, hops: range, dtype: torch.dtype):
    """A reference of the gossiped sample in ``dtype``: before each hop every rank rounds its sample to ``dtype``,
    then sums the weighted rounded samples of itself and its in-peers in float32, in rank order."""
    samples = [g.clone() for g in gradients]
    for t in hops:
        rounded = [a.to(dtype).float() for a in samples]
        for rank in range(len(samples)):
            view = schedule.peers(rank, t)
            own = 1.0 - sum(weight for _, weight in view.in_peers)
            total = torch.zeros_like(samples[rank])
            for peer, weight in sorted([(rank, own), *view.in_peers]):
                total.add_(rounded[peer], alpha=weight)
            samples[rank] = total
    return samples


@pytest.mark.parametrize(
    ("mean_gradient", "schedule", "n", "arrives_at", "dtype"),
    [
        ("allreduce", "one_peer_hypercube", 4, 0, None),  # all-reduced at the step it is due
        ("gossip", "one_peer_hypercube", 4, 2, torch.float32),  # hops at steps 1 and 2 (log2 4)
        ("gossip", "base_graph", 6, 6, torch.float32),  # hops from the next period's first step, 3, over its 4 steps
    ],
)
def test_the_sample_is_the_mean_gradient_of_all_ranks(mean_gradient, schedule, n, arrives_at, dtype):
    """Step 0's sample reaches every rank's second moment as (1 - beta2^K) mean(g)^2: at once by an all-reduce, after
    the schedule's exact hops by gossip; the same on every rank (bit for bit where the rows of W(t) pair ranks
    alike: the all-reduce and the hypercube)."""
    results = gossip.simulate(n, _sampled_second_moment, mean_gradient, schedule, arrives_at + 2, dtype)
    mean = torch.stack([r["gradient"] for r in results]).double().mean(0)
    expected = ((1 - BETAS[1] ** 16) * mean.square()).float()
    for rank, result in enumerate(results):
        assert result["samples"] == [0] * arrives_at + [1, 1], f"rank {rank}"
        assert result["workers"] == n
        torch.testing.assert_close(result["shared"], expected, rtol=1e-5, atol=1e-12)
        if schedule == "one_peer_hypercube":
            assert torch.equal(result["shared"], results[0]["shared"]), f"rank {rank}"


@pytest.mark.parametrize(
    ("schedule", "n", "hops"), [("one_peer_hypercube", 8, range(1, 4)), ("base_graph", 6, range(3, 7))]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sample_sent_in_half_precision_is_the_mean_of_the_rounded_hops_on_every_rank(schedule, n, hops, dtype):
    """With the hops in a half-precision dtype (bfloat16 is the default) every rank is handed what rounding each
    hop's sample to it and summing in float32 in rank order gives, bit for bit -- on the hypercube the same on
    every rank -- and that is the exact mean up to one rounding a hop of the largest gradient."""
    results = gossip.simulate(n, _sampled_second_moment, "gossip", schedule, hops[-1] + 1, dtype)
    gradients = [r["gradient"] for r in results]
    reference = _rounded_gossip(gradients, topologies.by_name(schedule, n), hops, dtype)
    exact = torch.stack(gradients).double().mean(0)
    info = torch.finfo(dtype)  # a rounding moves a value by at most half its spacing: eps/2 relative, or subnormal
    largest = torch.stack(gradients).abs().amax(0).double()
    bound = len(hops) * (info.eps / 2) * (largest + info.smallest_normal) * 1.01
    for rank, result in enumerate(results):
        (handed,) = result["handed"]
        assert torch.equal(handed, reference[rank]), f"rank {rank}"
        assert ((handed.double() - exact).abs() <= bound).all(), f"rank {rank}"
        assert not torch.equal(handed, exact.float())  # the rounding shows
        if schedule == "one_peer_hypercube":
            assert torch.equal(handed, results[0]["handed"][0]), f"rank {rank}"


def test_the_sample_travels_in_bfloat16_by_default():
    assert inspect.signature(gossip.DecentralizedDataParallel).parameters["mean_gradient_dtype"].default is (
        torch.bfloat16
    )
    assert gossip.Pipeline().mean_gradient_dtype is torch.bfloat16


def _bytes_per_step(comm, mean_gradient: str) -> list[dict]:
    return tracked_steps(
        comm, "exact", True, steps=6, optimizer_factory=momentum_tracking_adamw, mean_gradient=mean_gradient
    )


def test_a_step_that_all_reduces_its_sample_costs_one_more_all_reduce_of_the_gradients():
    """every 2 steps on the one-peer hypercube: steps 0, 2, 4 send the trackers', the parameters' and the
    all-reduce's bytes, steps 1, 3, 5 the first two only (and steps 1 and 2 the optimizers' comparison)."""
    per_rank = gossip.simulate(N, _bytes_per_step, "allreduce")
    for rows in per_rank:
        sent = [row["bytes_sent"] for row in rows]
        model_bytes = rows[0]["x"].numel() * 4
        assert sent[3] == sent[5] == 2 * model_bytes  # parameters and trackers, one peer each
        assert sent[1] == 2 * model_bytes + MESSAGE_BYTES
        assert sent[0] - 2 * model_bytes == ring_all_reduce_bytes(model_bytes, N)  # the MLP fits one bucket
        assert sent[4] == sent[0] and sent[2] == sent[0] + MESSAGE_BYTES


def test_a_gossiped_sample_costs_one_model_to_one_peer_per_hop_and_no_collective():
    """every 2 steps on the one-peer hypercube of 4 (2 hops a sample): from step 1 on every step carries one hop,
    one more model to the step's peer, in bfloat16 (half a float32 model); nothing is all-reduced."""
    per_rank = gossip.simulate(N, _bytes_per_step, "gossip")
    for rows in per_rank:
        sent = [row["bytes_sent"] for row in rows]
        model_bytes = rows[0]["x"].numel() * 4
        hop = model_bytes // 2
        assert sent[0] == 2 * model_bytes
        assert sent[1] == sent[2] == 2 * model_bytes + hop + MESSAGE_BYTES  # the optimizers compared at steps 1, 2
        assert sent[3:] == [2 * model_bytes + hop] * 3


def test_a_sample_due_before_the_last_one_is_averaged_is_refused_by_name():
    def run(comm) -> str:
        model = wrap(comm, make_mlp(comm.rank), gradient_tracking=True)
        optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, second_moment_every=2)
        try:
            for step in range(4):
                loss_of(model, *batch(comm.rank, step)).backward()
                optimizer.step()
                optimizer.zero_grad()
        except InvalidArgumentError as error:
            return str(error)
        return "accepted"

    for rank, message in enumerate(gossip.simulate(8, run)):
        assert message.startswith(f"step 2: rank {rank}: the optimizer samples the mean gradient again while the last "
                                  "sample still needs 1 of its 3 gossip steps over 'one_peer_hypercube'; raise its "
                                  "second_moment_every to at least 3"), message  # fmt: skip


@pytest.mark.parametrize("factory", [momentum_tracking_adamw, tracker_momentum_tracking_adamw])
def test_resume_is_bit_identical(tmp_path, factory):
    """Sampled every 2 steps, or read off the tracker (its last tracker is state too)."""
    results = gossip.simulate(
        N,
        lambda comm: checkpoint_resume(
            comm,
            tmp_path / f"r{comm.rank}",
            gossip.PowerGossip,
            optimizer_factory=factory,
            gradient_tracking=True,
        ),
    )
    for rank, result in enumerate(results):
        assert result["resumed_at"] == 3
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def _mismatched_optimizers(comm, plain_rank: int | None, every_on_rank_2: int) -> str:
    model = wrap(comm, make_mlp(comm.rank), gradient_tracking=True)
    every = every_on_rank_2 if comm.rank == 2 else 4
    if comm.rank == plain_rank:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, second_moment_every=every)
    try:
        for step in range(4):
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    except GossipError as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize(
    ("odd_rank", "its_kind", "every_on_rank_2"),
    [
        (2, "MomentumTrackingAdamW(second_moment_every=8)", 8),
        (1, "an optimizer that steps on .grad (not a momentum source)", 4),
    ],
)
def test_ranks_that_disagree_on_the_optimizer_are_named_by_their_peers(odd_rank, its_kind, every_on_rank_2):
    """The optimizers are compared with each step's peers from the step after the first optimizer step: at step 1
    of the hypercube of 4 the odd rank and its partner (rank XOR 2) name each other; the other two stop at their
    next exchange with one of them (a timeout here)."""
    plain_rank = 1 if odd_rank == 1 else None
    messages = gossip.simulate(N, _mismatched_optimizers, plain_rank, every_on_rank_2, timeout=5.0)
    usual = "MomentumTrackingAdamW(second_moment_every=4)"
    partner = odd_rank ^ 2
    assert messages[odd_rank] == (
        f"ReplicaMismatchError: step 1: rank {odd_rank}: peer {partner}'s optimizer is {usual} where this rank's is "
        f"{its_kind}: with gradient tracking or momentum tracking every rank must use the same optimizer with the "
        "same second_moment_every"
    )
    assert messages[partner].startswith(
        f"ReplicaMismatchError: step 1: rank {partner}: peer {odd_rank}'s optimizer is {its_kind} where this rank's is "
    )
    for rank in set(range(N)) - {odd_rank, partner}:
        assert messages[rank].startswith("CommTimeoutError: step 2: "), messages[rank]


def _misuse(comm, how: str) -> str:
    model = wrap(comm, make_mlp(comm.rank), gradient_tracking=True)
    optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, second_moment_every=2)
    loss = loss_of(model, *batch(comm.rank, 0))
    try:
        if how == "closure":
            optimizer.step(lambda: loss)
        else:
            loss.backward()
            model.finish_mixing()
            optimizer.step()
    except (InvalidArgumentError, StepPhaseError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        model.close()
    return "accepted"


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("closure", "InvalidArgumentError: rank {rank}: step 0: MomentumTrackingAdamW.step(closure)"),
        ("finish_mixing", "StepPhaseError: rank {rank}: step 0: finish_mixing() ran before MomentumTrackingAdamW"),
    ],
)
def test_a_closure_and_an_explicit_finish_mixing_are_refused(how, expected):
    for rank, message in enumerate(gossip.simulate(2, _misuse, how)):
        assert message.startswith(expected.format(rank=rank)), message


def _without_tracking(comm, plain_rank: int | None) -> str:
    model = wrap(comm, make_mlp(comm.rank))
    if comm.rank == plain_rank:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, second_moment_every=2)
    try:
        for step in range(3):  # the plain rank goes on until an exchange needs the peer that has stopped
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        outcome = "accepted"
    except GossipError as error:
        outcome = f"{type(error).__name__}: {error}"
    with contextlib.suppress(GossipError):  # closing beside a stopped (or a further) peer may itself fail
        model.close()
    return outcome


@pytest.mark.parametrize("plain_rank", [None, 1])
def test_momentum_tracking_without_gradient_tracking_is_refused_on_its_rank_before_any_collective(plain_rank):
    """Without trackers the first moment has nowhere to go: each MomentumTrackingAdamW rank names the fix at its
    first step without waiting for the others, so a rank with an ordinary optimizer beside it cannot leave it
    waiting for an agreement the plain rank never joins; the plain rank's exchange with it then names the peer that
    has closed."""
    expected = "InvalidArgumentError: rank {rank}: step 0: MomentumTrackingAdamW runs its first moment through the "
    messages = gossip.simulate(2, _without_tracking, plain_rank, timeout=5.0)
    for rank, message in enumerate(messages):
        if rank == plain_rank:
            assert message.startswith("ExchangeMismatchError: step 2: rank 1: ") and "peer 0 is in close()" in message
        else:
            assert message.startswith(expected.format(rank=rank)) and "gradient_tracking=True" in message, message


def test_momentum_tracking_trains():
    def losses(comm) -> list[float]:
        model = wrap(comm, make_mlp(comm.rank), gradient_tracking=True)
        optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, betas=BETAS, second_moment_every=2)
        values = []
        for step in range(20):
            loss = loss_of(model, *batch(comm.rank, step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            values.append(loss.item())
        model.close()
        return values

    per_rank = gossip.simulate(N, losses)
    first, last = sum(r[0] for r in per_rank) / N, sum(r[-1] for r in per_rank) / N
    assert last < 0.8 * first


class _Branches(torch.nn.Module):
    """A head no step reaches (``unused``) and a branch that only the odd ranks reach, on even steps."""

    def __init__(self):
        super().__init__()
        self.body, self.branch = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8)
        self.head, self.unused = torch.nn.Linear(8, 3), torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, through_branch: bool) -> torch.Tensor:
        hidden = torch.relu(self.body(x))
        return self.head(hidden + self.branch(hidden) if through_branch else hidden)


def _steps_with_unreached_parameters(comm, trackers: str) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model, optimizer = gossip.Pipeline(trackers=trackers).wrap(_Branches(), comm, lr=1e-2)
    generator = torch.Generator().manual_seed(comm.rank)
    for step in range(6):
        x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        torch.nn.functional.cross_entropy(model(x, comm.rank % 2 == 1 and step % 2 == 0), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    named = dict(model.module.named_parameters())
    steps = {name: optimizer.state[p]["step"] for name, p in named.items()}
    model.close()
    return steps, {name: p.detach().clone() for name, p in named.items()}


@pytest.mark.parametrize("trackers", ["sign", "exact"])
def test_a_parameter_a_step_does_not_reach_counts_as_a_zero_gradient_in_the_first_moment_too(trackers):
    """The tracker counts a missing ``.grad`` as 0; the first moment before it must too, or the optimizer steps a
    parameter whose moments never counted a step (a bias correction of 1 - beta^0 = 0: NaN). Every parameter's
    moments count every step, the replicas stay finite, and with exact trackers the head no rank reaches, whose
    trackers stay 0, stays equal on every rank."""
    per_rank = gossip.simulate(N, _steps_with_unreached_parameters, trackers)
    for rank, (steps, values) in enumerate(per_rank):
        assert set(steps.values()) == {6}, (rank, steps)
        assert all(value.isfinite().all() for value in values.values()), rank
    if trackers == "exact":
        for _, values in per_rank[1:]:
            assert torch.equal(values["unused.weight"], per_rank[0][1]["unused.weight"])
