"""GPU tier for the outer optimizer and the tracker options: the simulator with 4 virtual ranks holding CUDA
tensors against the same run on the CPU. Skipped where no CUDA device exists; ``GOSSIP_TEST_DEVICE=cpu`` runs it
on the CPU to check the test itself.

Tolerances as in test_gpu_tier.py: CUDA may contract a*x + y into one fused multiply-add (exact gossip, the outer
step, the tracker's corrections) and reduces PowerGossip's matrix products in another order."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.algorithm_scenarios import local_model
from torch import nn

import gossip
import topologies
from gossip.algorithms.buckets import Bucket

DEVICE = torch.device(os.environ.get("GOSSIP_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _powergossip(rank: int) -> gossip.PowerGossip:
    return gossip.PowerGossip(rank=rank, min_compression=1)


OUTER = {
    "diloco": lambda: gossip.DiLoCo(local_steps=3),
    "gossip": lambda: gossip.OuterOptimizer(gossip.ExactGossip(), 3),
    "powergossip-delayed-hybrid": lambda: gossip.OuterOptimizer(
        _powergossip(2), 3, delay=1, merge=0.5, between=_powergossip(1)
    ),
}


def outer_run(comm: gossip.Communicator, name: str, steps: int = 8) -> dict:
    buckets = [Bucket(b.buffer.to(comm.device), b.entries) for b in local_model(comm.rank)]
    algorithm = OUTER[name]()
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    for step in range(steps):
        algorithm.step(step)
        generator = torch.Generator().manual_seed(1000 * comm.rank + step)
        for bucket in buckets:
            bucket.buffer.add_((0.01 * torch.randn(bucket.buffer.shape, generator=generator)).to(comm.device))
    algorithm.drain()
    return {
        "device": {b.buffer.device.type for b in buckets},
        "replica": torch.cat([b.buffer for b in buckets]).cpu(),
        "theta": torch.cat(algorithm.synchronised()).cpu(),
    }


@pytest.mark.parametrize("name", sorted(OUTER))
def test_the_outer_optimizer_on_cuda_matches_the_cpu_run(name):
    on_device = gossip.simulate(4, outer_run, name, device=DEVICE)
    on_cpu = gossip.simulate(4, outer_run, name)
    for got, expected in zip(on_device, on_cpu, strict=True):
        assert got["device"] == {DEVICE.type}
        for key in ("replica", "theta"):
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)


def tracked(comm: gossip.Communicator, steps: int = 6) -> dict:
    generator = torch.Generator().manual_seed(comm.rank)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    model = gossip.DecentralizedDataParallel(
        module.to(comm.device),
        comm,
        topologies.one_peer_hypercube(comm.size),
        _powergossip(1),
        gradient_tracking=_powergossip(1),
        tracking_overlap=True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        data = torch.Generator().manual_seed(100 * comm.rank + step)
        x = torch.randn(8, 16, generator=data).to(comm.device)
        (model(x) - x[:, :4]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    result = {
        "y": torch.cat([t.buffer for t in model.tracker.trackers]).cpu(),
        "g": torch.cat(model.tracker.previous).cpu(),
        "x": torch.cat([b.buffer for b in model.buckets]).cpu(),
    }
    model.close()
    return result


def test_overlapped_powergossip_trackers_on_cuda_match_the_cpu_run_and_keep_the_sum():
    on_device = gossip.simulate(4, tracked, device=DEVICE)
    on_cpu = gossip.simulate(4, tracked)
    for got, expected in zip(on_device, on_cpu, strict=True):
        for key in ("y", "x"):
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    y = torch.stack([r["y"] for r in on_device]).double().sum(0)
    g = torch.stack([r["g"] for r in on_device]).double().sum(0)
    torch.testing.assert_close(y, g, rtol=0, atol=1e-5)
