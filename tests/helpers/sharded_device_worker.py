"""Worker for tests/test_sharded_gpu.py: sharded replicas on one device, a world of one (1 replica x 1 shard).

Usage: ``python tests/helpers/sharded_device_worker.py DEVICE OUT`` with DEVICE ``cuda`` (NCCL) or ``cpu`` (Gloo).
FSDP2 shards a small GPT over the device's mesh, ``gossip.init_lanes`` builds the lanes on the mesh's backend, and
the default pipeline's parts (PowerGossip, sign trackers, ``MomentumTrackingAdamW``) train it; then a DCP checkpoint
and a resume. Writes what ran where, the losses, and the resumed against the uninterrupted parameters.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gossip
import optim
from gossip.app.gpt import GPT, GPTConfig
from gossip.checkpoint.sharded import load_sharded_dcp, save_sharded_dcp

STEPS, SAVE_AT = 12, 8


def build(mesh, lanes, device: str):
    torch.manual_seed(0)
    net = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)).to(device)
    for block in net.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"], reshard_after_forward=True)
    pipeline = gossip.Pipeline(second_moment_every=4)
    model = gossip.ShardedDecentralizedDataParallel(
        net, lanes, pipeline.build_schedule(1), pipeline.algorithm(), gradient_tracking=pipeline.tracking()
    )
    return model, net, pipeline.optimizer(optim.param_groups(net, 0.1), lr=3e-3)


def train(model, optimizer, steps: range, device: str) -> list[float]:
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)  # arithmetic progressions: a next byte to learn
        starts, strides = (
            torch.randint(0, 256, (8, 1), generator=generator),
            torch.randint(1, 4, (8, 1), generator=generator),
        )
        tokens = ((starts + strides * torch.arange(33)) % 256).to(device)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    device, out = sys.argv[1], Path(sys.argv[2])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("replicate", "shard"))
    lanes = gossip.init_lanes(mesh, timeout=60.0)
    model, net, optimizer = build(mesh, lanes, device)
    losses = train(model, optimizer, range(SAVE_AT), device)
    save_sharded_dcp(out.parent / "checkpoint", model, optimizer)
    losses += train(model, optimizer, range(SAVE_AT, STEPS), device)
    with model.averaged() as average:
        averaged = [p.full_tensor().detach().cpu().clone() for p in average.parameters()]
    uninterrupted = [p.full_tensor().detach().cpu().clone() for p in net.parameters()]
    seen = {"parameters": sorted({p.device.type for p in net.parameters()}), "lane": lanes.lane.backend,
            "placements": sorted({str(p.placements) for p in net.parameters()})}  # fmt: skip
    model.close()
    model, net, optimizer = build(mesh, lanes, device)
    resumed_at = load_sharded_dcp(out.parent / "checkpoint", model, optimizer)
    train(model, optimizer, range(SAVE_AT, STEPS), device)
    resumed = [p.full_tensor().detach().cpu().clone() for p in net.parameters()]
    model.close()
    lanes.lane.close()
    lanes.shard.close()
    dist.destroy_process_group()
    torch.save({**seen, "losses": losses, "averaged": averaged, "uninterrupted": uninterrupted, "resumed": resumed,
                "resumed_at": resumed_at}, out)  # fmt: skip


if __name__ == "__main__":
    main()
