"""Construction-time agreement checks and the buffers policy of DecentralizedDataParallel (simulator)."""

from __future__ import annotations

import pytest
import torch
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap
from torch import nn

import gossip
import topologies
from gossip.algorithms.exact import ExactGossip
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.replicas import ReplicaMismatchError

N = 4


def build(
    comm, make_module, make_schedule=topologies.one_peer_hypercube, make_algorithm=lambda r: ExactGossip()
) -> str:
    try:
        DecentralizedDataParallel(make_module(comm.rank), comm, make_schedule(comm.size), make_algorithm(comm.rank))
    except ReplicaMismatchError as error:
        return str(error)
    return "no error"


def wider_on_rank_2(rank: int) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 17 if rank == 2 else 16), nn.Linear(16, 4))


def test_shape_mismatch_raises_on_every_rank_naming_rank_and_parameter():
    messages = gossip.simulate(N, build, wider_on_rank_2)
    assert len(set(messages)) == 1
    assert "rank 2: parameter '0.weight' is float32[17, 8]" in messages[0]
    assert "rank 0 it is float32[16, 8]" in messages[0]


def test_dtype_mismatch_names_the_rank_and_parameter():
    messages = gossip.simulate(N, build, lambda r: nn.Linear(3, 2).double() if r == 3 else nn.Linear(3, 2))
    assert all("rank 3: parameter 'weight' is float64[2, 3]" in m for m in messages)


def test_renamed_parameter_names_both_names():
    def module(rank: int) -> nn.Module:
        return nn.Sequential(nn.Linear(3, 2)) if rank == 1 else nn.ModuleDict({"fc": nn.Linear(3, 2)})

    messages = gossip.simulate(N, build, module)
    assert all("rank 1 has parameter '0.weight' where rank 0 has parameter 'fc.weight'" in m for m in messages)


def test_schedule_mismatch_is_refused():
    def run(comm) -> str:
        try:
            make = topologies.ring if comm.rank == 1 else topologies.one_peer_hypercube
            DecentralizedDataParallel(nn.Linear(3, 2), comm, make(comm.size), ExactGossip())
        except ReplicaMismatchError as error:
            return str(error)
        return "no error"

    assert all(m.startswith("rank 1 uses schedule ring(n=4") for m in gossip.simulate(N, run))


def test_algorithm_config_mismatch_is_refused():
    messages = gossip.simulate(
        N,
        build,
        lambda r: nn.Linear(3, 2),
        topologies.one_peer_hypercube,
        lambda r: ExactGossip(gamma=0.5 if r == 3 else 1.0),
    )
    assert all("rank 3 uses algorithm {'name': 'exact', 'gamma': 0.5}" in m for m in messages)


def test_a_rank_sending_powergossip_products_in_another_dtype_is_refused():
    messages = gossip.simulate(
        N,
        build,
        lambda r: nn.Linear(8, 8),
        topologies.one_peer_hypercube,
        lambda r: gossip.PowerGossip(rank=2, message_dtype=torch.float16 if r == 2 else None),
    )
    assert all("rank 2 uses algorithm" in m and "'message_dtype': 'torch.float16'" in m for m in messages), messages


def test_schedule_for_another_world_size_is_refused():
    messages = gossip.simulate(N, build, lambda r: nn.Linear(3, 2), lambda n: topologies.ring(8))
    assert all("schedule 'ring' is built for n=8 ranks but the world has 4" in m for m in messages)


def test_unknown_buffers_policy_is_refused_before_any_communication():
    with pytest.raises(ValueError, match="buffers must be one of"):
        gossip.simulate(2, lambda comm: wrap(comm, nn.Linear(3, 2), buffers="sync"))


def test_construction_broadcasts_rank_0_parameters_and_buffers():
    def run(comm) -> tuple[torch.Tensor, torch.Tensor]:
        module = make_mlp(comm.rank, batch_norm=True)
        module[1].running_mean.fill_(comm.rank)
        model = wrap(comm, module)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        model.close()
        return params, module[1].running_mean.clone()

    results = gossip.simulate(N, run)
    reference = make_mlp(0, batch_norm=True)
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    for params, running_mean in results:
        assert torch.equal(params, expected)
        assert torch.equal(running_mean, torch.zeros(16))


def running_means(comm, policy: str) -> torch.Tensor:
    module = make_mlp(comm.rank, batch_norm=True)
    model = wrap(comm, module, buffers=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.close()
    return module[1].running_mean.clone()


def test_local_buffers_stay_different_across_ranks():
    means = gossip.simulate(N, running_means, "local")
    assert all(not torch.allclose(means[0], other) for other in means[1:])


def test_average_buffers_are_equal_across_ranks_after_each_step():
    local = gossip.simulate(N, running_means, "local")
    averaged = gossip.simulate(N, running_means, "average")
    for other in averaged[1:]:
        assert torch.equal(averaged[0], other)
    assert not torch.allclose(averaged[0], local[0])
