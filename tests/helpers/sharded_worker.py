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
import gossip.checkpoint
import topologies
from gossip.backends.lanes import Lanes, init_lanes
from gossip.checkpoint.sharded import load_sharded_dcp, save_sharded_dcp
from gossip.wrapper.sharded import ShardedDecentralizedDataParallel
from optim import MomentumTrackingAdamW

R, G = 2, 2
#: a mixing matrix of two replicas that is not the average, so that "equals unsharded gossip" is not "averages"
W = [[0.75, 0.25], [0.25, 0.75]]
LR = 0.1


def _net() -> nn.Sequential:
    """11 rows split 6 + 5 over the two shards (FSDP2 pads the second), and a 1-row layer whose second shard is
    empty: the uneven layouts FSDP2 makes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 11), nn.Tanh(), nn.Linear(11, 1))


def _shard(net: nn.Module, mesh: DeviceMesh) -> nn.Module:
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _batch(replica: int, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * replica + shard)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 1, generator=generator)


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
    with model.averaged():  # between two steps, the next exchange in flight
        result["averaged"] = _full(net)
    result["after_averaged"] = _full(net)
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


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, lanes: Lanes, steps: range) -> None:
    for step in steps:
        x, y = _batch(lanes.lane.rank, lanes.shard.rank, step)
        x = x + 0.01 * torch.randn_like(x)  # the RNG stream is part of the checkpoint too
        _loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _powergossip_run(
    mesh: DeviceMesh, lanes: Lanes, rank: int = 1
) -> tuple[ShardedDecentralizedDataParallel, nn.Module, Any]:
    net = _shard(_net(), mesh["shard"])
    schedule = topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    algorithm = gossip.PowerGossip(rank=rank)
    model = ShardedDecentralizedDataParallel(net, lanes, schedule, algorithm, gradient_tracking=True)
    return model, net, torch.optim.AdamW(model.parameters(), lr=0.01)


def checkpoint_resume(mesh: DeviceMesh, lanes: Lanes, out_dir: Path, result: dict) -> None:
    """k steps, save (one DCP directory per replica), m more; a fresh run loads and runs the same m (PowerGossip's
    factors, the gradient trackers, AdamW's moments and the RNG streams are all part of the state)."""
    k, m = 2, 2
    directory = out_dir / "checkpoints"
    model, net, optimizer = _powergossip_run(mesh, lanes)
    _train(model, optimizer, lanes, range(k))
    result["saved_at"] = _full(net)
    save_sharded_dcp(directory, model, optimizer, extra={"progress": {"epoch": 3}})
    _train(model, optimizer, lanes, range(k, k + m))
    result["uninterrupted"] = _full(net)
    result["uninterrupted_local"] = [p.to_local().clone() for p in net.parameters()]
    model.close()
    model, net, optimizer = _powergossip_run(mesh, lanes)
    result["missing"] = _refusal(lambda: load_sharded_dcp(out_dir / "nowhere", model, optimizer))
    progress: dict = {}
    result["resumed_at_step"] = load_sharded_dcp(directory, model, optimizer, extra={"progress": progress})
    result["progress"] = progress
    result["loaded"] = _full(net)
    _train(model, optimizer, lanes, range(k, k + m))
    result["resumed"] = _full(net)
    result["resumed_local"] = [p.to_local().clone() for p in net.parameters()]
    result["directories"] = sorted(path.name for path in directory.iterdir())
    model.close()
    model, net, optimizer = _powergossip_run(mesh, lanes, rank=2)  # another run: PowerGossip of rank 2
    result["other_run"] = _refusal(lambda: load_sharded_dcp(directory, model, optimizer, extra={"progress": {}}))
    model.close()
    result["checkpoint_dir"] = str(directory)
    model.close()


def _pipeline_run(mesh: DeviceMesh, lanes: Lanes) -> tuple[ShardedDecentralizedDataParallel, nn.Module, Any]:
    """The default pipeline's parts on the shards: PowerGossip, sign trackers, momentum tracking."""
    net = _shard(_net(), mesh["shard"])
    schedule = topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    model = ShardedDecentralizedDataParallel(net, lanes, schedule, gossip.PowerGossip(rank=1), gradient_tracking="sign")
    return model, net, _momentum_optimizer(model.parameters())


def pipeline_resume(mesh: DeviceMesh, lanes: Lanes, out_dir: Path, result: dict) -> None:
    """3 steps of the pipeline's parts, save while the mean gradient's sample is 1 hop short of exact, 3 more; a
    fresh run loads and runs the same 3 (the sample in progress, the trackers' public copies, the momentum
    optimizer's h, v and u are all part of the state)."""
    k, m = 3, 3
    directory = out_dir / "pipeline-checkpoints"
    model, net, optimizer = _pipeline_run(mesh, lanes)
    _train(model, optimizer, lanes, range(k))
    save_sharded_dcp(directory, model, optimizer)
    _train(model, optimizer, lanes, range(k, k + m))
    uninterrupted, samples = _full(net), optimizer.state[next(iter(net.parameters()))]["samples"]
    model.close()
    model, net, optimizer = _pipeline_run(mesh, lanes)
    resumed_at = load_sharded_dcp(directory, model, optimizer)
    _train(model, optimizer, lanes, range(k, k + m))
    result["pipeline_resume"] = {"uninterrupted": uninterrupted, "resumed": _full(net), "resumed_at": resumed_at,
                                 "samples": samples, "trackers": type(model.tracker.mixing).__name__}  # fmt: skip
    model.close()


def refusals(mesh: DeviceMesh, lanes: Lanes, out_dir: Path, result: dict) -> None:
    """What the sharded wrapper, the lanes and the checkpoints refuse, each by its named error (FSDP1, which needs
    an accelerator to build, is refused in tests/test_sharded_layout.py without a process group)."""
    refused = result["refused"] = {}
    ring = topologies.ring(2)

    def wrap(net: nn.Module, schedule: Any = ring, **settings: Any) -> Any:
        return lambda: ShardedDecentralizedDataParallel(net, lanes, schedule, gossip.ExactGossip(), **settings)

    refused["hsdp"] = _refusal(wrap(_shard(_net(), mesh)))  # the 2-D mesh: FSDP would average across replicas
    refused["other_group"] = _refusal(wrap(_shard(_net(), mesh["replicate"])))
    refused["plain"] = _refusal(wrap(_net()))
    shard = lanes.shard.rank
    refused["lane_settings"] = _refusal(wrap(_shard(_net(), mesh["shard"]), seed=shard))
    schedule = ring if shard == 0 else topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    refused["lane_schedule"] = _refusal(wrap(_shard(_net(), mesh["shard"]), schedule))
    refused["mesh_1d"] = _refusal(lambda: init_lanes(mesh["shard"]))
    refused["not_lanes"] = _refusal(
        lambda: ShardedDecentralizedDataParallel(_shard(_net(), mesh["shard"]), lanes.lane, ring, gossip.ExactGossip())
    )
    model = ShardedDecentralizedDataParallel(_shard(_net(), mesh["shard"]), lanes, ring, gossip.ExactGossip())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    _train(model, optimizer, lanes, range(1))
    refused["save_checkpoint"] = _refusal(lambda: gossip.checkpoint.save_checkpoint(out_dir / "pt", model, optimizer))
    refused["save_dcp"] = _refusal(lambda: gossip.checkpoint.save_dcp(out_dir / "dcp", model, optimizer))
    refused["unsharded_to_sharded_save"] = _refusal(lambda: save_sharded_dcp(out_dir / "x", object(), optimizer))
    _train(model, optimizer, lanes, range(1, 2))  # still in lockstep after the refusals
    result["steps_after_refusals"] = model.step_count
    model.close()


def tracking_against_unsharded(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """Gradient tracking on the shards against R unsharded replicas with trackers, mixed by W here."""
    r, j = lanes.lane.rank, lanes.shard.rank
    net = _net()
    references = [copy.deepcopy(net) for _ in range(R)]
    _shard(net, mesh["shard"])
    schedule = topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    model = ShardedDecentralizedDataParallel(net, lanes, schedule, gossip.ExactGossip(), gradient_tracking=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    shapes = [p.shape for p in references[0].parameters()]
    trackers = [[torch.zeros(shape) for shape in shapes] for _ in range(R)]
    previous = [[torch.zeros(shape) for shape in shapes] for _ in range(R)]
    run: dict[str, list] = {"full": [], "expected_full": [], "tracker": [], "expected_tracker": [], "gradients": []}
    for step in range(3):
        x, y = _batch(r, j, step)
        _loss(model(x), y).backward()
        optimizer.step()
        run["tracker"].append([p.grad.full_tensor().clone() for p in net.parameters()])  # y_i: what it stepped on
        optimizer.zero_grad()
        # the reference: y_i <- sum_k W_ik (y_k + g_k - g_k^prev); x_i <- sum_k W_ik x_k - lr y_i
        gradients = []
        for i, reference in enumerate(references):
            _reference_gradient(reference, i, step)
            gradients.append([p.grad.clone() for p in reference.parameters()])
        corrected = [
            [t + g - q for t, g, q in zip(trackers[i], gradients[i], previous[i], strict=True)] for i in range(R)
        ]
        trackers = [[sum(W[i][k] * corrected[k][n] for k in range(R)) for n in range(len(shapes))] for i in range(R)]
        previous = gradients
        before = [[p.detach().clone() for p in reference.parameters()] for reference in references]
        with torch.no_grad():
            for i, reference in enumerate(references):
                for n, p in enumerate(reference.parameters()):
                    p.copy_(sum(W[i][k] * before[k][n] for k in range(R)) - LR * trackers[i][n])
        run["full"].append(_full(net))
        run["expected_full"].append([p.detach().clone() for p in references[r].parameters()])
        run["expected_tracker"].append(trackers[r])
        run["gradients"].append(gradients[r])
    result["tracking"] = run
    model.close()
    model.close()


MOMENTUM_STEPS, SAMPLE_EVERY = 8, 4  # W averages inexactly: a sample takes inexact_hops(2) = 4 hops


def _momentum_optimizer(params: Any) -> MomentumTrackingAdamW:
    return MomentumTrackingAdamW(params, lr=0.01, betas=(0.9, 0.95), second_moment_every=SAMPLE_EVERY)


def _unsharded_momentum_tracking(comm: gossip.Communicator, schedule: Any, nets: list[nn.Module]) -> list[Any]:
    """Replica ``comm.rank`` unsharded, under the library's own wrapper (one simulated rank a replica, ``nets`` built
    before the simulated ranks' threads start: seeding torch's one generator from two threads at once would mix
    their draws): the parameters after each step."""
    net = nets[comm.rank]
    model = gossip.DecentralizedDataParallel(net, comm, schedule, gossip.ExactGossip(), gradient_tracking="exact")
    optimizer = _momentum_optimizer(model.parameters())
    trajectory = []
    for step in range(MOMENTUM_STEPS):
        batches = [_batch(comm.rank, j, step) for j in range(G)]
        (sum(_loss(model(x), y) for x, y in batches) / G).backward()  # the replica's gradient, as FSDP2 forms it
        optimizer.step()
        optimizer.zero_grad()
        trajectory.append([p.detach().clone() for p in net.parameters()])
    model.close()
    return trajectory


def momentum_against_unsharded(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """Momentum tracking (MomentumTrackingAdamW, exact trackers, the mean gradient gossiped) on the shards against
    R unsharded replicas under the library's unsharded wrapper, the same W, on the simulator in this process."""
    r, j = lanes.lane.rank, lanes.shard.rank
    schedule = topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    net = _shard(_net(), mesh["shard"])
    model = ShardedDecentralizedDataParallel(net, lanes, schedule, gossip.ExactGossip(), gradient_tracking="exact")
    optimizer = _momentum_optimizer(model.parameters())
    run: dict[str, list] = {"full": [], "samples": []}
    for step in range(MOMENTUM_STEPS):
        x, y = _batch(r, j, step)
        _loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        run["full"].append(_full(net))
        run["samples"].append(optimizer.state[next(iter(net.parameters()))]["samples"])
    run["expected_full"] = gossip.simulate(R, _unsharded_momentum_tracking, schedule, [_net() for _ in range(R)])[r]
    result["momentum"] = run
    model.close()


def frozen_parameters(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """A frozen parameter (sharded by FSDP2 too) starts from replica 0's values, as DDP's, and is never mixed."""
    net = _net()
    net[0].bias.requires_grad_(False)
    _shard(net, mesh["shard"])
    with torch.no_grad():  # the replicas differ in every parameter before wrapping
        for p in net.parameters():
            p.to_local().add_(float(lanes.lane.rank))
    result["frozen_before"] = net[0].bias.full_tensor().clone()
    model = ShardedDecentralizedDataParallel(net, lanes, topologies.ring(2), gossip.ExactGossip())
    result["frozen_after"] = net[0].bias.full_tensor().clone()
    result["frozen_placement"] = str(net[0].bias.placements)
    model.close()


class _WithUnusedHead(nn.Module):
    """``_net`` beside a head that no forward reaches."""

    def __init__(self):
        super().__init__()
        self.net = _net()
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def unreached_parameter(mesh: DeviceMesh, lanes: Lanes, result: dict) -> None:
    """The pipeline's parts on the shards of a model with a head no step reaches: FSDP2 leaves its gradient None,
    the wrapper gives it a zero one before the first moment (the tracker's reading of a missing gradient)."""
    net = _WithUnusedHead()
    fully_shard(net.net[0], mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    schedule = topologies.from_matrix(torch.tensor(W).numpy(), name="w")
    model = ShardedDecentralizedDataParallel(net, lanes, schedule, gossip.PowerGossip(rank=1), gradient_tracking="sign")
    optimizer = _momentum_optimizer(model.parameters())
    _train(model, optimizer, lanes, range(4))
    result["unreached"] = {
        "steps": {name: optimizer.state[p]["step"] for name, p in net.named_parameters()},
        "finite": {name: bool(p.full_tensor().isfinite().all()) for name, p in net.named_parameters()},
    }
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
    frozen_parameters(mesh, lanes, result)
    exact_against_unsharded(mesh, lanes, result)
    tracking_against_unsharded(mesh, lanes, result)
    momentum_against_unsharded(mesh, lanes, result)
    powergossip_blocks(mesh, lanes, result)
    checkpoint_resume(mesh, lanes, out_dir, result)
    pipeline_resume(mesh, lanes, out_dir, result)
    unreached_parameter(mesh, lanes, result)
    refusals(mesh, lanes, out_dir, result)
    lanes.lane.close()
    lanes.shard.close()
    torch.save(result, out_dir / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
