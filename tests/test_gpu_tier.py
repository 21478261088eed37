"""GPU tier on one GPU: what can be tested without one GPU per rank. Skipped where no CUDA device exists.

* the simulator with n virtual ranks holding CUDA tensors, every algorithm, against the same run on CPU:
  bit-identical where the arithmetic is the same sequence of correctly rounded IEEE operations (all-reduce: sums
  in rank order, one division); within stated tolerances where CUDA may contract a*x + y into one fused
  multiply-add (exact gossip: 1e-6) or reduces in another order (PowerGossip's matrix products: 1e-4);
* DecentralizedDataParallel on CUDA parameters with a world of 1 on NCCL (mixing is the identity there, so the
  wrapped model trains exactly like the bare one);
* AccumAdamW's foreach path on CUDA against its per-tensor path and against the CPU;
* momentum tracking (the gradients' all-reduce, the trackers, MomentumTrackingAdamW) on CUDA against the CPU;
* ChocoSign (the scaled-sign codec's torch bit path) on CUDA: the sum kept, both ends of every edge holding
  bit-identical copies, the replicas contracting; and momentum tracking with sign trackers, its trackers' sum;
* bf16 autocast through the wrapper.

``GOSSIP_TEST_DEVICE=cpu`` runs the same tests on the CPU (NCCL replaced by Gloo), to check the tier itself
without a GPU.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers.algorithm_scenarios import local_model, make_schedule
from torch import nn

import gossip
import optim
import topologies
from gossip.algorithms import PowerGossipTuning
from gossip.algorithms.buckets import Bucket
from gossip.app.gpt import GPT, GPTConfig
from gossip.wrapper.parallel import DecentralizedDataParallel

DEVICE = torch.device(os.environ.get("GOSSIP_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ALGORITHMS = {
    "exact": lambda: gossip.ExactGossip(),
    "exact-overrelaxed": lambda: gossip.ExactGossip(gamma=1.2),
    "powergossip-r1": lambda: gossip.PowerGossip(rank=1, min_compression=1),
    "powergossip-r2-2it": lambda: gossip.PowerGossip(rank=2, num_iterations=2, min_compression=1),
    "powergossip-r2-fp32": lambda: gossip.PowerGossip(
        rank=2, min_compression=1, tuning=PowerGossipTuning(orthonormalize_dtype=torch.float32)
    ),
    "powergossip-r4-qr": lambda: gossip.PowerGossip(
        rank=4, min_compression=1, tuning=PowerGossipTuning(orthonormalization="qr")
    ),
    "powergossip-r2-2it-fp16": lambda: gossip.PowerGossip(
        rank=2, num_iterations=2, min_compression=1, message_dtype=torch.float16
    ),
    "powergossip-r2-2it-delayed": lambda: gossip.PowerGossip(
        rank=2, num_iterations=2, min_compression=1, delayed_last_iteration=True
    ),
    "adaptive-powergossip": lambda: gossip.AdaptivePowerGossip(ladder=(1, 2), every=3, min_compression=1),
    "allreduce": lambda: gossip.AllReduce(),
    "hierarchical": lambda: gossip.HierarchicalGossip(local_size=2),
    "hierarchical-r1": lambda: gossip.HierarchicalGossip(compress_rank=1, local_size=2, min_compression=1),
}
# (rtol, atol) of the CUDA run against the CPU run; None: bit-identical.
TOLERANCE = {
    "exact": (0, 1e-6),
    "exact-overrelaxed": (0, 1e-6),
    "allreduce": None,
    # a product that differs in its last float32 bit can round to the neighbouring float16 (2^-11 relative, about
    # 2e-3 of these products' magnitude of 4): R, and so the correction, may differ by that much per iteration
    "powergossip-r2-2it-fp16": (1e-2, 1e-2),
}


def mix(comm: gossip.Communicator, algorithm: str, steps: int = 6) -> dict:
    buckets = [Bucket(b.buffer.to(comm.device), b.entries) for b in local_model(comm.rank)]
    algo = ALGORITHMS[algorithm]()
    schedule = "ring" if algorithm.startswith("exact-") else "hypercube"
    algo.setup(comm, None if algorithm.startswith("hierarchical") else make_schedule(schedule, comm.size), buckets)
    for step in range(steps):
        algo.step(step)
    algo.drain()  # a delayed last iteration: completed and dropped
    total = torch.cat([b.buffer.double() for b in buckets])
    comm.all_reduce(total)
    edges = getattr(algo, "edges", {})
    return {
        "buffers": [b.buffer.cpu() for b in buckets],
        "device": {b.buffer.device.type for b in buckets},
        "sum": total.cpu(),
        "factors": {key: [t.cpu() for t in e.p + e.q] for key, e in edges.items()},
    }


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_simulator_on_cuda_matches_the_cpu_run(algorithm):
    on_device = gossip.simulate(4, mix, algorithm, device=DEVICE)
    on_cpu = gossip.simulate(4, mix, algorithm)
    initial = sum(torch.cat([b.buffer.double() for b in local_model(rank)]) for rank in range(4))
    for rank, (got, expected) in enumerate(zip(on_device, on_cpu, strict=True)):
        assert got["device"] == {DEVICE.type}
        tolerance = TOLERANCE.get(algorithm, (1e-4, 1e-5))
        for x, y in zip(got["buffers"], expected["buffers"], strict=True):
            if tolerance is None:
                assert torch.equal(x, y), f"rank {rank}: {algorithm} on {DEVICE} differs from the CPU run"
            else:
                torch.testing.assert_close(x, y, rtol=tolerance[0], atol=tolerance[1])
        torch.testing.assert_close(got["sum"], initial, rtol=0, atol=1e-4)  # the average is preserved
        for (lo, hi), factors in got["factors"].items():  # both ends of every edge agree bit for bit
            theirs = on_device[hi if rank == lo else lo]["factors"][(lo, hi)]
            assert all(torch.equal(a, b) for a, b in zip(factors, theirs, strict=True)), (algorithm, lo, hi)


def make_mlp() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.to(DEVICE)


def train_mlp(model: nn.Module, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=generator).to(DEVICE)
        loss = (model(x) - x[:, :4]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_wrapper_on_cuda_parameters_with_a_world_of_one_on_nccl(monkeypatch):
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    comm = gossip.init("nccl" if DEVICE.type == "cuda" else "gloo", timeout=60.0)
    try:
        assert comm.device.type == DEVICE.type
        wrapped = DecentralizedDataParallel(make_mlp(), comm, topologies.ring(1), gossip.ExactGossip())
        bare = make_mlp()
        wrapped_losses, bare_losses = train_mlp(wrapped, 5), train_mlp(bare, 5)
        assert all(p.is_cuda == (DEVICE.type == "cuda") for p in wrapped.parameters())
        assert wrapped_losses == bare_losses
        assert all(torch.equal(a, b) for a, b in zip(wrapped.module.parameters(), bare.parameters(), strict=True))
    finally:
        comm.close()


def train_momentum_tracked(comm: gossip.Communicator, algorithm: gossip.Algorithm, trackers) -> nn.Module:
    """Six steps of momentum tracking with ``algorithm`` and ``trackers`` (the mean gradient every 2 steps); the
    wrapper is returned open."""
    model = DecentralizedDataParallel(
        make_mlp().to(comm.device), comm, topologies.one_peer_hypercube(comm.size), algorithm,
        gradient_tracking=trackers,
    )  # fmt: skip
    optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), second_moment_every=2)
    generator = torch.Generator().manual_seed(comm.rank)
    for _ in range(6):
        x = torch.randn(8, 16, generator=generator).to(comm.device)
        (model(x) - x[:, :4]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def momentum_tracked(comm: gossip.Communicator) -> torch.Tensor:
    """Exact gossip and exact trackers: the parameters after six steps."""
    model = train_momentum_tracked(comm, gossip.ExactGossip(), True)
    parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    model.close()
    return parameters


def test_momentum_tracking_on_cuda_matches_the_cpu_run():
    """The wrapper's gradient all-reduce, tracker exchange and MomentumTrackingAdamW on CUDA tensors, against the CPU:
    within the tolerance of float32 kernels that may fuse or reorder (the ranks' data differ, so mixing matters)."""
    on_device = gossip.simulate(4, momentum_tracked, device=DEVICE)
    on_cpu = gossip.simulate(4, momentum_tracked)
    for got, expected in zip(on_device, on_cpu, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.equal(on_cpu[0], on_cpu[1])


def choco_sign_mixed(comm: gossip.Communicator, steps: int) -> dict:
    """``steps`` steps of ChocoSign (four magnitudes per 16 values) on the one-peer hypercube, on ``comm.device``."""
    buckets = [Bucket(b.buffer.to(comm.device), b.entries) for b in local_model(comm.rank)]
    algorithm = gossip.ChocoSign(chunk=16, levels=4)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    for step in range(steps):
        algorithm.step(step)
    flat = torch.cat([b.buffer.double() for b in buckets])
    total, mean = flat.clone(), flat.clone()
    comm.all_reduce(total)
    comm.all_reduce(mean, "avg")
    copies = {peer: [t.cpu() for t in pair[0] + pair[1]] for peer, pair in algorithm.public.items()}
    return {
        "device": {b.buffer.device.type for b in buckets},
        "sum": total.cpu(),
        "spread": float((flat - mean).square().sum()),
        "copies": comm.all_gather_object(copies),
    }


def test_choco_sign_on_cuda_keeps_the_sum_and_both_ends_of_every_edge_identical():
    before = gossip.simulate(4, choco_sign_mixed, 0, device=DEVICE)
    after = gossip.simulate(4, choco_sign_mixed, 30, device=DEVICE)
    initial = sum(torch.cat([b.buffer.double() for b in local_model(rank)]) for rank in range(4))
    for rank, result in enumerate(after):
        assert result["device"] == {DEVICE.type}
        torch.testing.assert_close(result["sum"], initial, rtol=0, atol=1e-4)
        assert result["spread"] < 0.1 * before[rank]["spread"]
        for peer, tensors in result["copies"][rank].items():
            half = len(tensors) // 2
            theirs = result["copies"][peer][rank]
            for mine, swapped in zip(tensors, theirs[half:] + theirs[:half], strict=True):
                assert torch.equal(mine, swapped), f"ranks {rank} and {peer} disagree on their edge's copies"


def sign_momentum_tracked(comm: gossip.Communicator) -> dict:
    """Sign trackers (the defaults' PowerGossip, at rank 2, for the parameters): their sum and their inputs'."""
    model = train_momentum_tracked(comm, gossip.PowerGossip(rank=2, num_iterations=2, min_compression=1), "sign")
    # the trackers z_i and what they track, this rank's first moment h_i (the tracker's previous input)
    trackers = torch.cat([t.buffer.double() for t in model.tracker.trackers])
    moments = torch.cat([h.double() for h in model.tracker.previous])
    for tensor in (trackers, moments):
        comm.all_reduce(tensor)
    finite = all(bool(p.isfinite().all()) for p in model.parameters())
    model.close()
    return {"trackers": trackers.cpu(), "moments": moments.cpu(), "finite": finite, "device": comm.device.type}


def test_sign_momentum_tracking_on_cuda_keeps_the_trackers_sum_the_first_moments_sum():
    for result in gossip.simulate(4, sign_momentum_tracked, device=DEVICE):
        assert result["finite"] and result["device"] == DEVICE.type
        torch.testing.assert_close(result["trackers"], result["moments"], rtol=0, atol=1e-5)


def accum_adamw_run(device: torch.device, foreach: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    params = [torch.randn(shape, generator=generator).to(device).requires_grad_() for shape in ((33, 7), (7,), (5,))]
    optimizer = optim.AccumAdamW(params, lr=1e-2, accum_iter=3, foreach=foreach)
    for _ in range(10):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device)
        optimizer.step()
    return [p.detach().cpu() for p in params]


def test_accum_adamw_foreach_on_cuda_matches_its_per_tensor_path_and_the_cpu():
    foreach = accum_adamw_run(DEVICE, True)
    for a, b in zip(foreach, accum_adamw_run(DEVICE, False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(foreach, accum_adamw_run(torch.device("cpu"), True), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def autocast_training(comm: gossip.Communicator) -> dict:
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    generator = torch.Generator().manual_seed(comm.rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    wrapped = DecentralizedDataParallel(
        model.to(comm.device), comm, topologies.one_peer_hypercube(comm.size), gossip.PowerGossip(rank=2)
    )
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    tokens = torch.randint(256, (8, config.block_size + 1), generator=generator).to(comm.device)
    losses = []
    for _ in range(15):
        with torch.autocast(comm.device.type, dtype=torch.bfloat16):
            _, loss = wrapped(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "dtypes": {p.dtype for p in wrapped.parameters()}, "loss_dtype": loss.dtype}


def test_bf16_autocast_through_the_wrapper_trains_in_float32_parameters():
    for result in gossip.simulate(2, autocast_training, device=DEVICE):
        assert result["dtypes"] == {torch.float32}  # autocast computes in bf16, parameters and mixing stay fp32
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["losses"][-1] < result["losses"][0] - 0.1, result["losses"]


def steps_under_sync_debug_mode(comm: gossip.Communicator, algorithm: str) -> str | None:
    """Steps 4 and 5 with CUDA's sync debug mode set to "error" (any device-to-host synchronisation raises); then
    rank 1 sends NaN at step 6, outside that window (writing a Python float into a CUDA tensor is itself a
    synchronising copy). Returns what the deferred non-finite check says afterwards. The steps before the window
    create the edges' state (host-to-device copies) and, with PowerGossip, run each plan's kernels once eagerly and
    once more (the simulator's ranks run PowerGossip's kernels one by one: tests/test_gpu_mpi.py has the graphs)."""
    buckets = [Bucket(b.buffer.to(comm.device), b.entries) for b in local_model(comm.rank)]
    algo = ALGORITHMS[algorithm]()
    algo.setup(comm, topologies.ring(comm.size), buckets)
    assert algo.deferred_nonfinite_check
    for step in range(4):
        algo.step(step)
    comm.barrier()
    if comm.rank == 0:
        torch.cuda.set_sync_debug_mode("error")  # process-wide: every virtual rank is under it
    comm.barrier()
    try:
        for step in (4, 5):  # both multiplication sides of PowerGossip
            algo.step(step)
        comm.barrier()
    finally:
        if comm.rank == 0:
            torch.cuda.set_sync_debug_mode("default")
    comm.barrier()
    if comm.rank == 1:
        buckets[0].buffer[0] = float("nan")
    algo.step(6)
    try:
        algo.check_deferred()
    except gossip.NonFiniteError as error:
        return str(error)
    return None


@pytest.mark.parametrize("algorithm", ["exact", "powergossip-r1", "powergossip-r2-2it-fp16"])
def test_a_step_on_cuda_reads_nothing_back_to_the_host_and_still_names_a_nonfinite_peer(algorithm):
    """The hot path has no device-to-host sync (the non-finite check is deferred by one step on CUDA), and the
    deferred check still names the rank, the peer and the step -- here on the real path: pinned flags, CUDA event."""
    if DEVICE.type != "cuda":
        pytest.skip("CUDA's sync debug mode and the deferred check exist only on a CUDA device")
    results = gossip.simulate(4, steps_under_sync_debug_mode, algorithm, device=DEVICE)
    for rank in (0, 2):  # on ring(4) ranks 0 and 2 receive from rank 1
        assert results[rank].startswith(f"rank {rank}: step 6: peer 1 sent non-finite values"), results[rank]
    if "2it" not in algorithm:
        assert results[1] is None and results[3] is None
    else:  # the second power iteration sends the products of ranks 0 and 2, which mixed rank 1's NaN in the first
        for rank in (1, 3):
            assert re.match(rf"rank {rank}: step 6: peer [02] sent non-finite values", results[rank]), results[rank]


def powergossip_graphs(comm: gossip.Communicator) -> object:
    buckets = [Bucket(b.buffer.to(comm.device), b.entries) for b in local_model(comm.rank)]
    algo = gossip.PowerGossip(rank=2, min_compression=1)
    algo.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    for step in range(4):
        algo.step(step)
    return algo._captured


def test_the_simulators_threads_launch_powergossips_kernels_one_by_one():
    """A CUDA graph capture in one thread is invalidated by another thread's device synchronisation, so the
    simulator's virtual ranks, threads sharing one GPU, do not capture (real ranks do: tests/test_gpu_mpi.py)."""
    assert gossip.simulate(4, powergossip_graphs, device=DEVICE) == [None] * 4
