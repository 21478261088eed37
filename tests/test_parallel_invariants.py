"""Invariants DecentralizedDataParallel relies on, each guarded by a named error, a warning or correct behaviour
(simulator): the parameters stay the ones wrapped, frozen parameters are broadcast, settings agree across ranks,
a closed wrapper or communicator is refused, evaluation cannot race the training exchange, a skipped update keeps
the ranks in lockstep, and non-finite buffers are not averaged in silently."""

from __future__ import annotations

import itertools
import time
import warnings

import numpy as np
import pytest
import torch
from helpers.parallel_scenarios import (
    batch,
    flat_parameters,
    loss_of,
    make_mlp,
    skip_one_update,
    train_with_an_extra_step_on_rank_1,
    weights_flip_on_rank_1,
    wrap,
)
from torch import nn

import gossip
import topologies
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.checkpoint import load_checkpoint
from gossip.errors import GossipError, InvalidArgumentError, NonFiniteError, NonFiniteWarning
from gossip.wrapper.parallel import AverageDriftWarning, DecentralizedDataParallel, MixingOnlyStepWarning
from gossip.wrapper.peer_agreement import MESSAGE_BYTES
from gossip.wrapper.replicas import ReplicaMismatchError
from topologies.schedule import Schedule

N = 4


def sgd_steps(model: DecentralizedDataParallel, optimizer, steps: range, rank: int) -> None:
    for step in steps:
        loss_of(model, *batch(rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()


def error_of(fn, *args) -> str:
    """Run ``fn`` on N simulated ranks that all make the same mistake; the message of the error it raises."""
    with pytest.raises(Exception) as caught:
        gossip.simulate(N, fn, *args, timeout=10.0)
    return f"{type(caught.value).__name__}: {caught.value}"


# -- 1, 2: the parameters must stay the ones wrapped ---------------------------------------------------------------
def train_after(comm, change) -> None:
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sgd_steps(model, optimizer, range(1), comm.rank)
    change(model.module)
    x, y = batch(comm.rank, 1)
    dtype = next(model.module.parameters()).dtype
    loss_of(model, x.to(dtype), y.to(dtype)).backward()
    optimizer.step()


@pytest.mark.parametrize(
    "change",
    [
        lambda module: module.double(),
        lambda module: module.to(torch.float64),
        lambda module: setattr(module[0].weight, "data", module[0].weight.data.clone()),
    ],
    ids=["double", "to-dtype", "data-rebound"],
)
def test_a_rebound_parameter_is_named_at_the_next_step(change):
    message = error_of(train_after, change)
    assert message.startswith("ModelChangedError: rank ")
    assert "step 1: parameter '0.weight' no longer lives in the wrapper's bucket: it was rebound" in message


def test_a_parameter_replaced_by_load_state_dict_assign_is_named():
    def reload(module: nn.Module) -> None:
        module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)

    message = error_of(train_after, reload)
    assert "step 1: parameter '0.weight' was replaced by another Parameter after wrapping" in message


def test_a_parameter_registered_after_wrapping_is_named():
    message = error_of(train_after, lambda module: module.add_module("late", nn.Linear(4, 4)))
    assert "step 1: parameter 'late.weight' was registered after wrapping; it would not be mixed" in message


def test_an_unmaterialised_lazy_module_is_refused_at_construction():
    def build(comm) -> None:
        wrap(comm, nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 4)))

    message = error_of(build)
    assert message.startswith("ReplicaMismatchError: rank 0: '0.weight' of the Sequential is not materialised yet")
    assert "run one forward pass on a sample batch before wrapping" in message


def test_a_lazy_module_materialised_before_wrapping_trains_like_its_eager_twin():
    def run(comm, lazy: bool) -> torch.Tensor:
        eager = make_mlp(comm.rank)
        if lazy:
            module = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 4))
            module(batch(comm.rank, 0)[0])  # the dry forward that gives the lazy layer its shape
            module.load_state_dict(eager.state_dict())
        model = wrap(comm, module if lazy else eager)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(3), comm.rank)
        model.close()
        return flat_parameters(model)

    for lazy, eager in zip(gossip.simulate(N, run, True), gossip.simulate(N, run, False), strict=True):
        assert torch.equal(lazy, eager)


# -- 3: frozen parameters ----------------------------------------------------------------------------------------
def frozen_first_layer(rank: int) -> nn.Sequential:
    module = make_mlp(rank)
    module[0].weight.requires_grad_(False)
    return module


def test_frozen_parameters_are_broadcast_from_rank_0():
    def run(comm) -> torch.Tensor:
        module = frozen_first_layer(comm.rank)
        wrap(comm, module).close()
        return module[0].weight.detach().clone()

    frozen = gossip.simulate(N, run)
    assert all(torch.equal(frozen[0], other) for other in frozen[1:])
    assert torch.equal(frozen[0], make_mlp(0)[0].weight.detach())


def test_a_parameter_frozen_on_one_rank_only_names_that_rank_and_the_cause():
    def build(comm) -> str:
        try:
            wrap(comm, frozen_first_layer(comm.rank) if comm.rank == 2 else make_mlp(comm.rank))
        except ReplicaMismatchError as error:
            return str(error)
        return "no error"

    assert (
        gossip.simulate(N, build)
        == [
            "rank 2: parameter '0.weight' is frozen (requires_grad=False) but on rank 0 it is trainable "
            "(requires_grad=True); freeze the same parameters on every rank"
        ]
        * N
    )


@pytest.mark.parametrize("unfreeze", [False, True], ids=["freeze", "unfreeze"])
def test_a_requires_grad_change_after_wrapping_is_named(unfreeze):
    def change(module: nn.Module) -> None:
        module[0].weight.requires_grad_(unfreeze)
        module[2].bias.requires_grad_(False)

    def build(comm) -> None:
        model = wrap(comm, frozen_first_layer(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(1), comm.rank)
        change(model.module)
        sgd_steps(model, optimizer, range(1, 2), comm.rank)

    name, old, new = ("0.weight", False, True) if unfreeze else ("2.bias", True, False)
    message = error_of(build)
    assert f"step 1: parameter '{name}' changed requires_grad from {old} to {new} after wrapping" in message


# -- 4, 5: the schedule --------------------------------------------------------------------------------------------
def test_a_schedule_not_doubly_stochastic_warns_that_the_average_drifts():
    def build(comm, weights: str) -> None:
        DecentralizedDataParallel(make_mlp(comm.rank), comm, topologies.star(4, weights), ExactGossip()).close()

    def drift_warnings(weights: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:  # around the simulation: the ranks are threads
            warnings.simplefilter("always")
            gossip.simulate(N, build, weights)
        return sorted(str(w.message) for w in caught if issubclass(w.category, AverageDriftWarning))

    uniform = drift_warnings("uniform")
    assert [m[:8] for m in uniform] == [f"rank {r}: " for r in range(N)]
    assert uniform[1].startswith("rank 1: schedule 'star' is row-stochastic but not doubly stochastic (")
    assert "gossip will not preserve the average of the replicas" in uniform[1]
    assert drift_warnings("metropolis") == []


@pytest.mark.filterwarnings("ignore::gossip.wrapper.parallel.AverageDriftWarning")
def test_the_average_does_drift_under_that_schedule_so_the_warning_is_due():
    def mean_after(comm) -> torch.Tensor:
        model = DecentralizedDataParallel(make_mlp(comm.rank), comm, topologies.star(4, "uniform"), ExactGossip())
        with torch.no_grad():
            model.buckets[0].buffer.add_(float(comm.rank))  # distinct replicas, mean shifted by 1.5
        mean_before = model.buckets[0].buffer.clone()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        sgd_steps(model, optimizer, range(3), comm.rank)
        model.close()
        return mean_before, model.buckets[0].buffer.clone()

    results = gossip.simulate(N, mean_after)
    before = torch.stack([b for b, _ in results]).mean(0)
    after = torch.stack([a for _, a in results]).mean(0)
    assert (after - before).abs().max() > 0.1


def pairings(rank: int, period: int | None, window: int = 32) -> Schedule:
    """Alternating pairings {0,1},{2,3} / {0,2},{1,3}; on rank 1 the alternation flips from step 40 on."""

    def step(t: int):
        flipped = rank == 1 and t >= 40
        pairs = [(0, 1), (2, 3)] if (t % 2 == 0) != flipped else [(0, 2), (1, 3)]
        rows = [i for a, b in pairs for i in (a, a, b, b)]
        cols = [j for a, b in pairs for j in (a, b, a, b)]
        return np.array(rows), np.array(cols), np.full(len(rows), 0.5)

    return Schedule(4, "pairs", step, period, window=window)


def test_a_periodic_schedule_is_compared_over_its_whole_period():
    def build(comm) -> str:
        try:
            DecentralizedDataParallel(make_mlp(comm.rank), comm, pairings(comm.rank, period=64), ExactGossip())
        except ReplicaMismatchError as error:
            return str(error)
        return "no error"

    messages = gossip.simulate(N, build)
    assert all(m.startswith("rank 1 uses schedule pairs(n=4, fingerprint ") for m in messages)


@pytest.mark.parametrize("window,caught", [(48, True), (32, False)])
def test_an_aperiodic_schedule_is_compared_over_its_window(window, caught):
    """What is checked for a schedule without period: its first ``window`` steps (the documented contract)."""
    assert (pairings(0, None, window).fingerprint() != pairings(1, None, window).fingerprint()) is caught


def run_with_other_weights(comm, steps: int) -> str:
    """``steps`` SGD steps on :func:`weights_flip_on_rank_1`; the error each rank meets."""
    schedule = weights_flip_on_rank_1(comm.rank)
    model = DecentralizedDataParallel(make_mlp(comm.rank), comm, schedule, ExactGossip(), consensus_every=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        sgd_steps(model, optimizer, range(steps), comm.rank)
    except GossipError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_an_aperiodic_schedule_with_other_weights_after_its_window_is_named_by_the_peers_at_that_step():
    """W(40) differs on rank 1 only in its weights: rank 1 and its step-40 peer compare W(40) in that step's
    message and both name it, at once; the others learn of it from the peers that stopped (a timeout here)."""
    messages = gossip.simulate(N, run_with_other_weights, 60, timeout=5.0)
    for rank, peer in ((0, 1), (1, 0)):
        assert messages[rank] == (
            f"ReplicaMismatchError: step 40: rank {rank}: peer {peer}'s schedule 'pairs' has another W(40) than this "
            "rank's (the same edges, other weights; construction compared the first 32 steps): build it the same "
            "way on every rank (same seed)"
        )
    assert all(m.startswith("CommTimeoutError: step 41: ") for m in messages[2:]), messages


def test_comparing_w_with_the_peers_sends_one_small_message_a_step_past_the_window():
    """Periodic schedules were compared whole at construction and send nothing more; a schedule without period sends
    one MESSAGE_BYTES message to each peer at every step past its window, and none within it."""

    def sent(comm) -> list[int]:
        model = DecentralizedDataParallel(
            make_mlp(comm.rank), comm, pairings(comm.rank, None), ExactGossip(), consensus_every=0
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        before = []
        for step in range(36):
            before.append(sum(comm.bytes_sent.values()))
            sgd_steps(model, optimizer, range(step, step + 1), comm.rank)
        model.close()
        return [b - a for a, b in itertools.pairwise(before)]

    per_step = gossip.simulate(N, sent)[0]  # [k]: what step k + 1 posted after step k's update (k >= 1)
    within, past = per_step[1:31], per_step[31:]  # the exchanges of steps 2..31, and of 32..35
    assert len(set(within)) == 1 and len(set(past)) == 1
    assert past[0] - within[0] == MESSAGE_BYTES


def test_the_same_run_without_the_flip_ends_cleanly_in_close_and_averaged():
    def run(comm) -> str:
        model = DecentralizedDataParallel(
            make_mlp(comm.rank), comm, pairings(comm.rank, None), ExactGossip(), consensus_every=0
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(38), comm.rank)  # pairings flip on rank 1 only from step 40
        with model.averaged():
            pass
        model.close()
        return "no error"

    assert gossip.simulate(N, run) == ["no error"] * N


# -- 7, 8, 18: wrappers and communicators that must not be used -------------------------------------------------
def test_wrapping_a_wrapper_is_refused():
    def build(comm) -> None:
        DecentralizedDataParallel(wrap(comm, make_mlp(comm.rank)), comm, topologies.ring(comm.size), ExactGossip())

    assert "ArgumentTypeError: rank 0: the module already contains a DecentralizedDataParallel" in error_of(build)


@pytest.mark.parametrize("operation", ["forward", "optimizer.step", "averaged", "load_checkpoint", "comm closed too"])
def test_training_after_close_is_refused(operation):
    def build(comm) -> None:
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(2), comm.rank)
        model.close()
        if operation == "comm closed too":
            comm.close()
        if operation == "optimizer.step":
            optimizer.step()
        elif operation == "averaged":
            with model.averaged():
                pass
        elif operation == "load_checkpoint":
            load_checkpoint(".", model, optimizer)
        else:
            loss_of(model, *batch(comm.rank, 2))

    what = {
        "optimizer.step": "optimizer step (mixing)",
        "averaged": "averaged()",
        "load_checkpoint": "load_checkpoint()",
    }
    message = error_of(build)
    assert f"UseAfterCloseError: rank 0: {what.get(operation, 'forward')} after close() (step 2)" in message


def test_a_closed_communicator_is_refused_at_once():
    def build(comm) -> float:
        comm.close()
        began = time.monotonic()
        try:
            wrap(comm, make_mlp(comm.rank))
        except GossipError as error:
            assert str(error).startswith(f"rank {comm.rank}: the communicator was already closed (comm.close())")
            return time.monotonic() - began
        return float("inf")

    assert max(gossip.simulate(N, build, timeout=30.0)) < 1.0


# -- 9, 14: settings that must agree across ranks ----------------------------------------------------------------
@pytest.mark.parametrize(
    "setting,values",
    [
        ("seed", (0, 2)),
        ("bucket_bytes", (1 << 20, 1 << 10)),
        ("buffers", ("local", "average")),
        ("consensus_every", (10, 5)),
        ("nonfinite", ("raise", "drop")),
    ],
)
def test_a_setting_that_differs_on_one_rank_is_refused(setting, values):
    def build(comm) -> str:
        try:
            if setting == "nonfinite":
                wrap(comm, make_mlp(comm.rank), ExactGossip(nonfinite=values[comm.rank == 2]))
            else:
                wrap(comm, make_mlp(comm.rank), **{setting: values[comm.rank == 2]})
        except ReplicaMismatchError as error:
            return str(error)
        return "no error"

    expected = (
        f"rank 2 uses {setting}={values[1]!r} but rank 0 uses {values[0]!r}; pass the same {setting} on every rank"
    )
    assert gossip.simulate(N, build) == [expected] * N


def test_a_mean_gradient_dtype_that_differs_on_one_rank_is_refused_before_any_hop():
    """Ranks sending the sample's hops in different dtypes would post messages of different sizes: the wrapper's
    construction compares the setting and names it."""

    def build(comm) -> str:
        dtype = torch.float32 if comm.rank == 2 else torch.bfloat16
        try:
            wrap(comm, make_mlp(comm.rank), gradient_tracking=True, mean_gradient_dtype=dtype)
        except ReplicaMismatchError as error:
            return str(error)
        return "no error"

    expected = (
        "rank 2 uses mean_gradient_dtype='torch.float32' but rank 0 uses 'torch.bfloat16'; pass the same "
        "mean_gradient_dtype on every rank"
    )
    assert gossip.simulate(N, build) == [expected] * N


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "bfloat16"])
def test_a_mean_gradient_dtype_outside_the_accepted_ones_is_refused_by_name(dtype):
    def build(comm) -> None:
        wrap(comm, make_mlp(comm.rank), gradient_tracking=True, mean_gradient_dtype=dtype)

    assert error_of(build) == (
        "InvalidArgumentError: rank 0: mean_gradient_dtype must be None or one of torch.bfloat16, torch.float16 and "
        f"torch.float32, got {dtype!r}"
    )
    with pytest.raises(InvalidArgumentError, match=r"^Pipeline: mean_gradient_dtype must be None or one of"):
        gossip.Pipeline(mean_gradient_dtype=dtype)


def test_a_run_dir_on_rank_0_only_logs_the_consensus_without_stalling(tmp_path):
    def run(comm) -> dict:
        model = wrap(comm, make_mlp(comm.rank), run_dir=tmp_path if comm.rank == 0 else None, consensus_every=5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(10), comm.rank)
        model.close()
        return model.metrics.last

    last = gossip.simulate(N, run, timeout=10.0)
    rows = [line for line in (tmp_path / "metrics_rank0.jsonl").read_text().splitlines() if '"consensus"' in line]
    assert len(rows) == 2 and sorted(p.name for p in tmp_path.glob("metrics_rank*")) == ["metrics_rank0.jsonl"]
    assert all("consensus" in row for row in last)  # step 9 (the 10th) sampled it on every rank


# -- 15: mixed dtypes with PowerGossip -------------------------------------------------------------------------------
def test_mixed_dtypes_with_powergossip_are_refused_at_construction():
    def build(comm) -> None:
        module = make_mlp(comm.rank)
        module[2].double()
        wrap(comm, module, PowerGossip(rank=1))

    message = error_of(build)
    assert message.startswith(
        "ArgumentTypeError: rank 0: PowerGossip sends each step's factors in one message of one dtype"
    )
    assert "the parameters have dtypes ['float32', 'float64']" in message


def test_mixed_dtypes_with_exact_gossip_mix_each_dtype():
    def run(comm) -> tuple[torch.Tensor, torch.Tensor]:
        module = make_mlp(comm.rank)
        module[2].double()
        model = wrap(comm, module)
        with torch.no_grad():
            for bucket in model.buckets:
                bucket.buffer.add_(float(comm.rank))
        before = [b.buffer.double().clone() for b in model.buckets]
        model.finish_mixing()
        model.next_step()
        model.close()
        return before, [b.buffer.double().clone() for b in model.buckets]

    results = gossip.simulate(N, run)
    assert len(results[0][0]) == 2  # one bucket per dtype
    for index in range(2):
        before = torch.stack([r[0][index] for r in results]).mean(0)
        after = torch.stack([r[1][index] for r in results]).mean(0)
        torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
        assert not torch.equal(results[0][1][index], results[0][0][index])


# -- 10: evaluation inside averaged() ---------------------------------------------------------------------------------
def test_the_wrappers_forward_inside_averaged_is_refused():
    def run(comm) -> None:
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(2), comm.rank)
        with model.averaged() as net:
            net(batch(comm.rank, 9)[0])  # the module it yields: fine
            model(batch(comm.rank, 9)[0])

    message = error_of(run)
    assert message.startswith("StepPhaseError: rank 0: step 2: the wrapper's forward was called inside averaged()")
    assert "Evaluate with the module that averaged() yields" in message


def test_an_optimizer_step_inside_averaged_is_refused_and_training_continues_after_the_block():
    def run(comm) -> tuple[str, torch.Tensor]:
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(2), comm.rank)
        loss_of(model, *batch(comm.rank, 2)).backward()
        try:
            with model.averaged():
                optimizer.step()
        except RuntimeError as error:
            message = str(error)
        optimizer.step()  # the step refused inside the block runs normally after it
        optimizer.zero_grad()
        sgd_steps(model, optimizer, range(3, 4), comm.rank)
        model.close()
        return message, flat_parameters(model)

    def reference(comm) -> torch.Tensor:
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, optimizer, range(4), comm.rank)
        model.close()
        return flat_parameters(model)

    for (message, params), expected in zip(gossip.simulate(N, run), gossip.simulate(N, reference), strict=True):
        assert message.startswith("rank ") and "optimizer.step() (or finish_mixing) inside averaged()" in message
        assert torch.equal(params, expected)


# -- 13: an update skipped on one rank -------------------------------------------------------------------------------
def test_a_grad_scaler_skipping_on_one_rank_keeps_the_ranks_in_lockstep_and_still_mixes():
    skipped = gossip.simulate(N, skip_one_update, True, timeout=10.0)
    reference = gossip.simulate(N, skip_one_update, False)
    for rank, ((params, steps), (expected, _)) in enumerate(zip(skipped, reference, strict=True)):
        assert steps == 5, f"rank {rank}"
        assert torch.equal(params, expected), f"rank {rank}: max diff {(params - expected).abs().max():.3g}"


def test_no_sync_accumulation_equals_plain_accumulation():
    def run(comm, use_no_sync: bool) -> torch.Tensor:
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            x, y = batch(comm.rank, step)
            chunks = list(zip(x.chunk(4), y.chunk(4), strict=True))
            for index, (xs, ys) in enumerate(chunks):
                last = index == len(chunks) - 1
                with model.no_sync() if use_no_sync and not last else torch.enable_grad():
                    (loss_of(model, xs, ys) / 4).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.close()
        return flat_parameters(model)

    for synced, plain in zip(gossip.simulate(N, run, True), gossip.simulate(N, run, False), strict=True):
        assert torch.equal(synced, plain)


# -- 6: non-finite buffers with buffers="average" ------------------------------------------------------------------
def nan_buffer_on_rank_2(comm, nonfinite: str) -> torch.Tensor:
    model = wrap(comm, make_mlp(comm.rank, batch_norm=True), ExactGossip(nonfinite=nonfinite), buffers="average")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sgd_steps(model, optimizer, range(1), comm.rank)
    if comm.rank == 2:
        model.module[1].running_mean[3] = float("nan")
    sgd_steps(model, optimizer, range(1, 2), comm.rank)
    model.close()
    return model.module[1].running_mean.clone()


def test_a_nan_buffer_with_buffers_average_names_the_rank_and_buffer():
    with pytest.raises(NonFiniteError) as caught:
        gossip.simulate(N, nan_buffer_on_rank_2, "raise")
    assert str(caught.value).startswith(
        "step 1: rank 0: buffer '1.running_mean' of rank(s) [2] holds non-finite values (NaN or Inf); "
        'buffers="average" would spread them to every rank'
    )


def test_a_nan_buffer_is_dropped_from_the_average_with_nonfinite_drop():
    with warnings.catch_warnings(record=True) as caught:  # around the simulation: the ranks are threads
        warnings.simplefilter("always")
        means = gossip.simulate(N, nan_buffer_on_rank_2, "drop")
    assert all(torch.isfinite(m).all() and torch.equal(m, means[0]) for m in means)
    dropped = sorted(str(w.message) for w in caught if issubclass(w.category, NonFiniteWarning))
    assert len(dropped) == N
    assert dropped[0] == (
        "rank 0: step 1: dropped the buffers of rank(s) [2] from the average (buffer '1.running_mean' holds NaN or Inf)"
    )


def extra_step_on_rank_1(comm) -> str:
    """Four training steps; rank 1 calls optimizer.step() twice in step 1 (a mixing-only step on one rank)."""
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        train_with_an_extra_step_on_rank_1(model, optimizer, comm.rank)
        model.close()
    except GossipError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_an_extra_optimizer_step_on_one_rank_is_named_at_close_by_both_ends_of_the_crossed_exchange():
    """An optimizer.step() without a forward is a mixing-only step: the exchanges stay matched by sequence number,
    so nothing can tell it from a deliberate one across ranks until the end; the rank warns at once. At close()
    its peer announces close() after 4 steps on the edge of the next exchange, where rank 1 already is (exchange
    5): both ends raise ExchangeMismatchError naming both numbers, without waiting for the timeout."""
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:  # around the simulation: the ranks are threads
        warnings.simplefilter("always")
        messages = gossip.simulate(N, extra_step_on_rank_1, timeout=2.0)
    assert time.monotonic() - began < 10.0
    assert [str(w.message) for w in caught if issubclass(w.category, MixingOnlyStepWarning)] == [
        "rank 1: step 2: optimizer.step() with no forward or backward since the previous step only mixes; unless "
        "every rank does the same, this rank is now one step ahead of its peers and close() will fail"
    ]
    assert messages[1].startswith(
        "ExchangeMismatchError: step 5: rank 1: exchange 5: message from peer 3: peer 3 is in close() after 4 "
        "optimizer steps: this rank took more steps than peer 3 (an optimizer.step() without a forward is a "
        "mixing-only step"
    )
    assert messages[3].startswith(
        "ExchangeMismatchError: step 4: rank 3: close() after 4 optimizer steps: message from peer 1 belongs to "
        "exchange 5: peer 1 took more steps than this rank"
    )
    for rank in (0, 2):  # in close()'s summary, waiting for the two that raised (a real process would have exited)
        assert messages[rank].startswith(f"CommTimeoutError: rank {rank}: all_gather_object #")
        assert messages[rank].endswith("still waiting for rank(s) [1, 3]")
