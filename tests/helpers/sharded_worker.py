"""Worker: 2 replicas x 2 FSDP2 shards on Gloo; every property of tests/test_sharded.py, observed in one job.

Each phase builds a fresh model from seed 0 (``_net``), shards it over ``mesh["shard"]`` and saves what the test
compares; the unsharded reference runs here too, on every rank, from the same seed and the same batches
(``_batch``: replica r, shard j, step t), so that the test can hold the sharded run to it.

Usage (by tests/helpers/launch.py): python tests/helpers/sharded_worker.py OUT_DIR
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import gossip
import topologies
from gossip.backends.lanes import Lanes, init_lanes
from gossip.wrapper.sharded import ShardedDecentralizedDataParallel

R, G = 2, 2
#: a mixing matrix of two replicas that is not the average, so that "equals unsharded gossip" is not "averages"
W = [[0.75, 0.25], [0.25, 0.75]]
LR = 0.1


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4))


def _shard(net: nn.Module, mesh: DeviceMesh) -> nn.Module:
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _batch(replica: int, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * replica + shard)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 4, generator=generator)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _reference_gradient(reference: nn.Module, replica: int, step: int) -> None:
    """The gradient FSDP2 gives replica ``replica``: the mean over its shards' batches (reduce-scatter averages)."""
    reference.zero_grad()
    loss = sum(_loss(reference(x), y) for x, y in (_batch(replica, j, step) for j in range(G))) / G
    loss.backward()


def _full(net: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def _refusal(build: Any) -> str:
    try:
        build()
    except gossip.GossipError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def without_gossip(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """Plain FSDP2 over mesh['shard'], no wrapper: each replica trains alone and matches its unsharded twin."""
    r = lanes.lane.rank
    net = _net()
    reference = copy.deepcopy(net)
    _shard(net, mesh["shard"])
    fired = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(3):
        x, y = _batch(r, lanes.shard.rank, step)
        _loss(net(x), y).backward()
        if step == 0:
            result["plain_hooks_fired"] = len(fired)
            result["plain_grads_set"] = all(p.grad is not None for p in net.parameters())
        optimizer.step()
        optimizer.zero_grad()
        _reference_gradient(reference, r, step)
        reference_optimizer.step()
    result["plain"] = _full(net)
    result["plain_reference"] = [p.detach().clone() for p in reference.parameters()]


def exact_against_unsharded(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """Exact gossip over W, sharded, against R unsharded replicas mixed by W here; then a skipped step."""
    r, j = lanes.lane.rank, lanes.shard.rank
    net = _net()
    references = [copy.deepcopy(net) for _ in range(R)]
    _shard(net, mesh["shard"])
    schedule = topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    model = ShardedDecentralizedDataParallel(net, lanes, schedule, gossip.ExactGossip())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outputs, expected_outputs, full, expected_full = [], [], [], []
    for step in range(3):
        x, y = _batch(r, j, step)
        output = model(x)
        outputs.append(output.detach().clone())
        expected_outputs.append(references[r](x).detach().clone())
        _loss(output, y).backward()
        if step == 0:
            result["backward_seen"] = model._backward_since_step
        optimizer.step()
        optimizer.zero_grad()
        # the reference: x_i <- sum_k W_ik x_k - lr g_i(x_i), the gradient at the unmixed x_i
        for i, reference in enumerate(references):
            _reference_gradient(reference, i, step)
        before = [[p.detach().clone() for p in reference.parameters()] for reference in references]
        with torch.no_grad():
            for i, reference in enumerate(references):
                for n, p in enumerate(reference.parameters()):
                    p.copy_(sum(W[i][k] * before[k][n] for k in range(R)) - LR * p.grad)
        full.append(_full(net))
        expected_full.append([p.detach().clone() for p in references[r].parameters()])
    plain = _net()
    plain.load_state_dict({name: p.full_tensor() for name, p in net.named_parameters()})
    x, _ = _batch(r, j, 3)
    result["mixed_forward"] = (plain(x).detach(), net(x).detach())
    result["exact"] = {"outputs": outputs, "expected_outputs": expected_outputs}
    result["exact"].update(full=full, expected_full=expected_full)
    # a step whose update replica 1 skips (backward, zero_grad, no step): it still mixes and stays in lockstep
    x, y = _batch(r, j, 4)
    _loss(model(x), y).backward()
    if r == 1:
        optimizer.zero_grad()
    else:
        optimizer.step()
        optimizer.zero_grad()
    x, y = _batch(r, j, 5)
    _loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    result["steps_after_skip"] = model.step_count
    model.close()


def complete_graph_step(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """Replicas made different, one complete-graph step of mixing only: placements, storage and the average."""
    net = _shard(_net(), mesh["shard"])
    result["refusal"] = _refusal(
        lambda: gossip.DecentralizedDataParallel(net, lanes.lane, topologies.ring(2), gossip.ExactGossip())
    )
    model = ShardedDecentralizedDataParallel(net, lanes, topologies.ring(2), gossip.ExactGossip())
    parameters = list(net.parameters())
    addresses = [p.to_local().data_ptr() for p in parameters]
    with torch.no_grad():  # the replicas differ from here on: replica r adds r to its shards
        for p in parameters:
            p.to_local().add_(float(lanes.lane.rank))
    result["before"] = _full(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step only mixes
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    result["after"] = _full(net)
    result["same_objects"] = all(a is b for a, b in zip(parameters, net.parameters(), strict=True))
    result["same_storage"] = addresses == [p.to_local().data_ptr() for p in parameters]
    result["placements"] = [str(p.placements) for p in parameters]
    result["consensus"] = model.consensus_distance()
    model.close()


def powergossip_blocks(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """PowerGossip in block mode on the shards: replicas made different, two steps that only mix."""
    net = _shard(_net(), mesh["shard"])
    schedule = topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    algorithm = gossip.PowerGossip(rank=1)
    model = ShardedDecentralizedDataParallel(net, lanes, schedule, algorithm)
    result["power_compressed"] = algorithm.describe()["compressed"]
    with torch.no_grad():
        for p in net.parameters():
            p.to_local().add_(float(lanes.lane.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the steps only mix
    steps = []
    for _ in range(2):
        before = _full(net)
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        (edge,) = algorithm.edges.values()
        steps.append(
            {
                "before": before,
                "after": _full(net),
                "p": [t.clone() for t in edge.p],
                "q": [t.clone() for t in edge.q],
            }
        )
    result["power"] = steps
    model.close()


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (R, G), mesh_dim_names=("replicate", "shard"))
    lanes = init_lanes(mesh, timeout=30.0)
    result: dict[str, Any] = {"replica": lanes.lane.rank, "shard": lanes.shard.rank}
    complete_graph_step(mesh, lanes, result)
    without_gossip(mesh, lanes, result)
    exact_against_unsharded(mesh, lanes, result)
    powergossip_blocks(mesh, lanes, result)
    lanes.lane.close()
    lanes.shard.close()
    torch.save(result, out_dir / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
