"""Bad input is refused through the public path a user hits, before any exchange, naming what and where.

Cases already covered elsewhere: schedule of another world size, ranks disagreeing on parameter names, shapes,
dtypes, schedule or algorithm (test_parallel_checks.py); schedule properties on construction
(test_topologies_validation.py); PowerGossip rank < 1 or larger than a matrix allows, asymmetric schedule
(test_algorithms_invariants.py); unavailable backends (test_bootstrap.py); launcher environments
(test_launch_env.py). Here: the same refusals through ``DecentralizedDataParallel`` and ``gossip.init``, and the
cases that were missing (empty model, zero-size parameters, device types, schedules that skipped validation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.parallel_scenarios import batch, loss_of, make_mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gossip
import gossip.wrapper.replicas
import topologies
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.errors import LaunchError
from gossip.wrapper.parallel import DecentralizedDataParallel
from topologies.schedule import Schedule, dense_to_triplets

N = 4
RING = np.array([[1, 1, 0, 1], [1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1]]) / 3.0


def unvalidated(matrix: np.ndarray) -> Schedule:
    """A static schedule that skipped validation (``validate=False``), as a hand-built one may."""
    triplets = dense_to_triplets(np.asarray(matrix, dtype=float))
    return Schedule(len(matrix), "hand_built", lambda phase: triplets, period=1, validate=False)


def wrap_or_error(comm, module, schedule, algorithm) -> str:
    """The error DecentralizedDataParallel raises, after checking that nothing was exchanged before it."""
    try:
        DecentralizedDataParallel(module, comm, schedule, algorithm)
    except (ValueError, gossip.GossipError) as error:
        assert comm.bytes_sent == {} and comm.bytes_received == {}
        return f"{type(error).__name__}: {error}"
    return "no error"


def refusals(module_of, schedule_of=lambda n: topologies.ring(n), algorithm_of=lambda: ExactGossip()) -> list[str]:
    return gossip.simulate(N, lambda comm: wrap_or_error(comm, module_of(comm.rank), schedule_of(N), algorithm_of()))


def test_empty_model_is_refused_on_every_rank():
    assert (
        refusals(lambda rank: nn.ReLU())
        == [
            "ReplicaMismatchError: rank 0: the ReLU has no trainable parameters (requires_grad=True): nothing to gossip"
        ]
        * N
    )


def test_frozen_model_is_refused_as_empty():
    def frozen(rank: int) -> nn.Module:
        return nn.Linear(3, 2).requires_grad_(False)

    assert all("the Linear has no trainable parameters" in m for m in refusals(frozen))


def test_model_of_zero_size_parameters_only_is_refused():
    def empty(rank: int) -> nn.Module:
        module = nn.Module()
        module.weight = nn.Parameter(torch.empty(0, 3))
        return module

    assert all("every trainable parameter of the Module has 0 elements" in m for m in refusals(empty))


def with_empty_parameter(rank: int) -> nn.Module:
    model = make_mlp(rank)
    model.register_parameter("empty", nn.Parameter(torch.empty(0, 5)))
    return model


def train(comm, make_module, algorithm, steps: int = 3) -> torch.Tensor:
    model = DecentralizedDataParallel(make_module(comm.rank), comm, topologies.ring(comm.size), algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.close()
    return torch.cat([p.detach().reshape(-1) for name, p in model.module.named_parameters() if name != "empty"])


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
def test_zero_size_parameters_travel_as_nothing(algorithm):
    with_it = gossip.simulate(N, lambda comm: train(comm, with_empty_parameter, algorithm()))
    without = gossip.simulate(N, lambda comm: train(comm, make_mlp, algorithm()))
    for rank in range(N):
        assert torch.equal(with_it[rank], without[rank]), f"rank {rank}"


def test_parameters_on_another_device_type_are_named(monkeypatch):
    signature = gossip.wrapper.replicas.run_signature

    def on_cuda_at_rank_1(module, comm, schedule, algorithm, settings=None):
        mine = signature(module, comm, schedule, algorithm, settings)
        if comm.rank == 1:
            mine["tensors"] = [(*row[:4], "cuda") for row in mine["tensors"]]
        return mine

    monkeypatch.setattr(gossip.wrapper.replicas, "run_signature", on_cuda_at_rank_1)
    messages = refusals(make_mlp)
    assert (
        messages
        == [
            "ReplicaMismatchError: rank 1: parameter '0.weight' is float32[16, 8] on cuda but on rank 0 it is "
            "float32[16, 8] on cpu"
        ]
        * N
    )


def test_schedule_of_another_world_size_is_refused():
    assert (
        refusals(make_mlp, lambda n: topologies.ring(n + 4))
        == ["ReplicaMismatchError: rank 0: schedule 'ring' is built for n=8 ranks but the world has 4"] * N
    )


@settings(max_examples=15, deadline=None)
@given(row=st.integers(0, N - 1), col=st.integers(0, N - 1), weight=st.floats(-2.0, -1e-3))
def test_negative_weight_in_an_unvalidated_schedule_is_refused(row, col, weight):
    matrix = RING.copy()
    matrix[row, col] = weight
    matrix[row, row if col != row else (row + 1) % N] += RING[row, col] - weight  # keep the row summing to one
    messages = refusals(make_mlp, lambda n: unvalidated(matrix))
    assert all(m.startswith("ScheduleError: ") and "non-negative" in m for m in messages), messages[0]


@settings(max_examples=15, deadline=None)
@given(row=st.integers(0, N - 1), excess=st.floats(1e-3, 1.0) | st.floats(-0.3, -1e-3))
def test_rows_not_summing_to_one_are_refused(row, excess):
    matrix = RING.copy()
    matrix[row, row] += excess
    messages = refusals(make_mlp, lambda n: unvalidated(matrix))
    assert all(m.startswith("ScheduleError: ") and "row-stochastic" in m for m in messages), messages[0]


def test_disconnected_unvalidated_schedule_is_refused():
    pairs = np.kron(np.eye(2), np.full((2, 2), 0.5))  # {0, 1} and {2, 3} never talk
    messages = refusals(make_mlp, lambda n: unvalidated(pairs))
    assert all(m.startswith("ScheduleError: ") and "connected" in m for m in messages), messages[0]


def test_asymmetric_schedule_is_refused_by_powergossip_at_wrapping():
    messages = refusals(make_mlp, topologies.one_peer_exponential, PowerGossip)
    assert all(m.startswith("ScheduleError: ") and "symmetric" in m for m in messages), messages[0]


def test_forced_powergossip_rank_larger_than_a_matrix_is_refused_at_wrapping():
    force_matrices = lambda name, shape: True if len(shape) == 2 else None  # noqa: E731
    messages = refusals(make_mlp, algorithm_of=lambda: PowerGossip(rank=5, policy=force_matrices))
    expected = "InvalidArgumentError: PowerGossip: rank 5 is larger than parameter '2.weight' of shape (4, 16) allows"
    assert messages == [f"{expected} (at most 4)"] * N


@pytest.mark.parametrize(
    ("env", "message"),
    [({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"), ({"RANK": "4", "WORLD_SIZE": "4"}, r"rank 4 is outside")],
)
def test_inconsistent_launcher_environment_is_refused_by_init(monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name in [k for k in __import__("os").environ if k.startswith(("PMI_", "OMPI_", "SLURM_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=message):
        gossip.init("gloo")


def test_nonfinite_policy_must_be_raise_or_drop():
    with pytest.raises(ValueError, match=r"ExactGossip: nonfinite must be one of \('raise', 'drop'\), got 'skip'"):
        ExactGossip(nonfinite="skip")
    with pytest.raises(ValueError, match="PowerGossip: nonfinite must be one of"):
        PowerGossip(nonfinite="ignore")
