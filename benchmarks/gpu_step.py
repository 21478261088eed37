"""Per-step costs of the library on one GPU, for a GPT-2-small-sized model (124 M parameters, built from a config).

Measured side by side in one run, medians over ``--rounds`` (each timed between two ``torch.cuda.synchronize``):

* forward + backward of one worker's batch (``--batch`` x ``--block`` tokens, bf16 autocast, fp32 parameters);
* PowerGossip's own computation per step at each ``--ranks`` (one rank's work: orthonormalisation, products,
  update, packing, the non-finite check; no network -- :class:`LoopbackCommunicator`), new vs the previous
  implementation when ``--baseline-file`` or a git checkout provides it (run with the immediate non-finite check,
  a host sync per step, as it was), with float64 orthonormalisation, with the other orthonormalisation method
  (batched QR on CUDA, where Gram-Schmidt is the default), and on a second copy of the model in one bucket
  (``--one-bucket-bytes``: each group of layers one strided view, one ``bmm`` per group); and its share of
  forward + backward;
* exact gossip's mixing per step (same loopback), and the scaled-sign trackers' (:class:`ChocoSign` with the sign
  momentum tracking settings, 4 magnitudes per 256 values, and with 1 magnitude per 128): codec, exchange, update;
* the optimizer step: AccumAdamW (foreach) vs ``torch.optim.AdamW(fused=True)``, and MomentumTrackingAdamW
  (foreach; its first-moment phase and its update, as the wrapper calls them in one step);
* ``--n`` virtual ranks on the simulator sharing the GPU, each with its own replica: wall time of one mixing step
  of all of them (exact, PowerGossip), i.e. what a one-GPU emulation of n workers costs per step;
* memory: the training step's peak (parameters, gradients, optimizer state, activations), PowerGossip's per-edge
  state (warm factors of one edge) and its transient peak during a step, and the simulator's peak with n
  replicas.

Usage::

    python benchmarks/gpu_step.py                      # GPT-2 small, batch 8 x 1024, ranks 1 4 16, n = 4
    python benchmarks/gpu_step.py --layers 2 --embd 64 --heads 2 --block 64 --vocab 256 --device cpu  # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from powergossip_compute import (
    BASELINE_REVISION,
    add_gpt2_small_arguments,
    bound_step,
    gpt_config,
    load_baseline,
    median_seconds,
    model_buckets,
    synchronize,
)

import optim
import topologies
from gossip import ChocoSign, ExactGossip, PowerGossip, simulate
from gossip.algorithms import PowerGossipTuning
from gossip.algorithms.buckets import Bucket


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def simulated_step(n: int, make: Callable[[], Any], source: list[Bucket], device: torch.device, rounds: int) -> float:
    """Wall seconds of one mixing step of ``n`` virtual ranks on ``device`` (median over ``rounds``)."""

    def rank(comm: Any) -> list[float]:
        buckets = [Bucket(b.buffer.clone().add_(comm.rank * 1e-3), b.entries) for b in source]
        algorithm = make()
        algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
        times = []
        for step in range(rounds + 2):
            comm.barrier()
            synchronize(device)
            start = time.perf_counter()
            algorithm.step(step)
            synchronize(device)
            comm.barrier()
            times.append(time.perf_counter() - start)
        return times[2:]

    per_rank = simulate(n, rank, device=device, timeout=600.0)
    return statistics.median(max(times) for times in zip(*per_rank, strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    add_gpt2_small_arguments(parser)
    parser.add_argument("--batch", type=int, default=8, help="sequences per worker and step")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--n", type=int, default=4, help="virtual ranks on the simulator (a power of two)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--baseline-file", default=None, help="the previous powergossip.py (else: git revision)")
    parser.add_argument("--baseline", default=BASELINE_REVISION, help="git revision of the previous implementation")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--one-bucket-bytes",
        type=int,
        default=1 << 40,
        help="also measure PowerGossip on a second copy of the model in buckets of this size (default: one bucket, "
        "so every group of layers is one strided view); 0: skip",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_step: skipped, no CUDA device here (this benchmark measures one GPU); a smoke run on the CPU: "
            "python benchmarks/gpu_step.py --layers 2 --embd 64 --heads 2 --block 64 --vocab 256 --device cpu"
        )
        return
    config = gpt_config(args)
    model, buckets = model_buckets(config, device, 0)
    parameters = sum(p.numel() for p in model.parameters())
    results: dict[str, Any] = {"parameters": parameters, "device": str(device), "config": vars(args)}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    try:
        Old = load_baseline(args.baseline, args.baseline_file)
    except Exception as error:  # no git checkout and no file: measure the new implementation alone
        print(f"no baseline: {error}")
        Old = None

    # Forward + backward and the optimizers.
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(config.vocab_size, (args.batch, config.block_size + 1), generator=generator).to(device)

    def forward_backward() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()

    before = reset_peak(device)
    results["forward_backward_s"] = base = median_seconds(forward_backward, device, args.warmup, args.rounds)
    results["forward_backward_peak_bytes"] = peak_bytes(device) - before
    optimizers = {
        "AccumAdamW (foreach)": optim.AccumAdamW(model.parameters(), lr=1e-4, accum_iter=2, foreach=True),
        "torch AdamW (fused)": torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda"),
        "MomentumTrackingAdamW (foreach)": optim.MomentumTrackingAdamW(model.parameters(), lr=1e-4, foreach=True),
    }
    results["optimizer_s"] = {}
    for name, optimizer in optimizers.items():
        run = optimizer.step
        if isinstance(optimizer, optim.MomentumTrackingAdamW):  # .grad <- h_i, then the update on it
            run = lambda optimizer=optimizer: (optimizer.prepare_momentum(), optimizer.step())  # noqa: E731
        results["optimizer_s"][name] = median_seconds(run, device, args.warmup, args.rounds)
    results["training_peak_bytes"] = peak_bytes(device)
    model.zero_grad(set_to_none=True)
    del optimizers
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # One rank's own computation per step (loopback), exact mixing and PowerGossip old / new. The previous
    # implementation runs with the immediate non-finite check it had (a host sync per step).
    variants: dict[str, tuple[Callable[[], Any], list[Bucket]]] = {
        "exact mixing": (ExactGossip, buckets),
        "sign trackers (ChocoSign, 4 magnitudes / 256)": (lambda: ChocoSign(chunk=256, levels=4), buckets),
        "sign trackers (ChocoSign, 1 magnitude / 128)": (lambda: ChocoSign(chunk=128, levels=1), buckets),
    }
    one_bucket = model_buckets(config, device, 0, args.one_bucket_bytes)[1] if args.one_bucket_bytes else None
    for rank in args.ranks:
        variants[f"powergossip r={rank}"] = (lambda rank=rank: PowerGossip(rank=rank), buckets)
        variants[f"powergossip r={rank}, op by op (no CUDA graphs)"] = (
            lambda rank=rank: PowerGossip(rank=rank, tuning=PowerGossipTuning(cuda_graphs=False)),
            buckets,
        )
        variants[f"powergossip r={rank}, fp64 orthonormalisation"] = (
            lambda rank=rank: PowerGossip(rank=rank, tuning=PowerGossipTuning(orthonormalize_dtype=torch.float64)),
            buckets,
        )
        # the other orthonormalisation: batched QR (the CPU's default; CUDA's default is Gram-Schmidt)
        other = "gram-schmidt" if device.type == "cpu" else "qr"
        variants[f"powergossip r={rank}, {other}"] = (
            lambda rank=rank, other=other: PowerGossip(rank=rank, tuning=PowerGossipTuning(orthonormalization=other)),
            buckets,
        )
        if Old is not None:
            variants[f"powergossip r={rank} (previous)"] = (lambda rank=rank: Old(rank=rank), buckets)
        if one_bucket is not None:
            variants[f"powergossip r={rank}, {len(one_bucket)} bucket(s)"] = (
                lambda r=rank: PowerGossip(rank=r),
                one_bucket,
            )
    results["own_s"], results["edge_state_bytes"], results["transient_peak_bytes"] = {}, {}, {}
    for name, (make, bound_buckets) in variants.items():
        algorithm = make()
        step = bound_step(algorithm, bound_buckets, device)
        if name.endswith("(previous)"):
            algorithm.deferred_nonfinite_check = False
        before = reset_peak(device)
        results["own_s"][name] = median_seconds(step, device, args.warmup, args.rounds)
        results["transient_peak_bytes"][name] = peak_bytes(device) - before
        edges = getattr(algorithm, "edges", {})
        results["edge_state_bytes"][name] = sum(
            t.numel() * t.element_size() for e in edges.values() for t in (*e.p, *e.q)
        )

    # n virtual ranks on the simulator.
    results["simulator_step_s"], results["simulator_peak_bytes"] = {}, {}
    for name, make in (("exact", ExactGossip), ("powergossip r=4", lambda: PowerGossip(rank=4))):
        before = reset_peak(device)
        results["simulator_step_s"][name] = simulated_step(args.n, make, buckets, device, args.rounds)
        results["simulator_peak_bytes"][name] = peak_bytes(device) - before

    report(results, base, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(results: dict[str, Any], base: float, args: argparse.Namespace) -> None:
    mib = 1 << 20
    print(f"device: {results.get('gpu', results['device'])}")
    print(
        f"model: GPT {args.layers} layers x {args.embd}, vocab {args.vocab}, {results['parameters'] / 1e6:.1f} M "
        f"parameters; batch {args.batch} x {args.block} tokens, bf16 autocast; medians of {args.rounds} rounds"
    )
    print("| per step | ms | % of forward+backward | peak extra memory (MiB) |")
    print("|---|---:|---:|---:|")
    print(f"| forward + backward | {base * 1e3:.2f} | 100 | {results['forward_backward_peak_bytes'] / mib:.0f} |")
    for name, value in results["optimizer_s"].items():
        print(f"| optimizer: {name} | {value * 1e3:.2f} | {100 * value / base:.1f} | |")
    for name, value in results["own_s"].items():
        state = results["edge_state_bytes"][name]
        extra = f"{results['transient_peak_bytes'][name] / mib:.0f}"
        extra += f" (+{state / mib:.1f} edge state)" if state else ""
        print(f"| own computation: {name} | {value * 1e3:.2f} | {100 * value / base:.2f} | {extra} |")
    for name, value in results["simulator_step_s"].items():
        print(
            f"| simulator, {args.n} virtual ranks: {name} (all ranks) | {value * 1e3:.2f} | {100 * value / base:.1f} | "
            f"{results['simulator_peak_bytes'][name] / mib:.0f} |"
        )
    print(f"training step peak (parameters, gradients, both optimizers' state, activations): "
          f"{results['training_peak_bytes'] / mib:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
