"""Worker: 2 replicas x 2 FSDP2 shards on Gloo, exact gossip between the lanes; saves this rank's observations.

Usage (by tests/helpers/launch.py): python tests/helpers/sharded_worker.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gossip
import topologies
from gossip.backends.lanes import init_lanes
from gossip.wrapper.sharded import ShardedDecentralizedDataParallel


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    fully_shard(net[0], mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    lanes = init_lanes(mesh, timeout=30.0)
    result = {}
    try:
        gossip.DecentralizedDataParallel(net, lanes.lane, topologies.ring(2), gossip.ExactGossip())
        result["refusal"] = "no error"
    except gossip.GossipError as error:
        result["refusal"] = f"{type(error).__name__}: {error}"
    model = ShardedDecentralizedDataParallel(net, lanes, topologies.ring(2), gossip.ExactGossip())
    parameters = list(net.parameters())
    addresses = [p.to_local().data_ptr() for p in parameters]
    with torch.no_grad():  # the replicas differ from here on: replica r adds r to its shards
        for p in parameters:
            p.to_local().add_(float(lanes.lane.rank))
    result["before"] = [p.full_tensor() for p in parameters]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step only mixes
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    result["after"] = [p.full_tensor() for p in parameters]
    result["same_objects"] = all(a is b for a, b in zip(parameters, net.parameters(), strict=True))
    result["same_storage"] = addresses == [p.to_local().data_ptr() for p in parameters]
    result["placements"] = [str(p.placements) for p in parameters]
    result["consensus"] = model.consensus_distance()
    result["replica"], result["shard"] = lanes.lane.rank, lanes.shard.rank
    model.close()
    lanes.lane.close()
    lanes.shard.close()
    torch.save(result, out_dir / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
