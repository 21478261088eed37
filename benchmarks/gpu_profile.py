"""Where PowerGossip's own computation per step goes on a GPU: kernels, launch gaps, and what a CUDA graph leaves.

One rank's step on a :class:`LoopbackCommunicator` (as in ``gpu_step.py``: no network), on GPT-2 small's
parameters in the default buckets, measured three ways in one run:

* **wall**: the step timed between two ``torch.cuda.synchronize`` (median of ``--rounds``);
* **profile** (``torch.profiler``, CPU and CUDA activity): kernels per step, the GPU's busy time per step (the
  union of the kernels' intervals), and so the idle share of the wall time -- the GPU waiting for the host to
  launch the next kernel; the kernels and the host operations that cost most;
* **CUDA graph**: two consecutive steps captured once (``torch.cuda.graph``) and replayed, so that launches cost
  nothing: what the same kernels take without the host. The non-finite check is left out of the captured steps
  (it records an event and reads the previous step's flags on the host, which a capture refuses).

Forward + backward of the model (bf16 autocast) is timed in the same run, so every number is also a share of it.

Usage::

    python benchmarks/gpu_profile.py                    # GPT-2 small, batch 8 x 1024, rank 4, default buckets
    python benchmarks/gpu_profile.py --ranks 1 4 --bucket-bytes 1099511627776    # one bucket
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from powergossip_compute import (
    add_gpt2_small_arguments,
    bound_step,
    gpt_config,
    median_seconds,
    model_buckets,
    synchronize,
)

from gossip import PowerGossip
from gossip.algorithms import PowerGossipTuning
from gossip.algorithms.buckets import DEFAULT_BUCKET_BYTES


def busy_microseconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (start, end), in their unit."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def profile_steps(step: Any, rounds: int, device: torch.device) -> dict[str, Any]:
    """Kernels, GPU busy time and the costliest kernels and host operations of ``rounds`` calls of ``step``."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(rounds):
            step()
        synchronize(device)
    events = profiler.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_kernel.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    host = profiler.key_averages()
    top_host = sorted(
        (a for a in host if a.key.startswith("aten::")), key=lambda a: a.self_cpu_time_total, reverse=True
    )[:15]
    launches = sum(a.count for a in host if a.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    return {
        "kernels_per_step": len(kernels) / rounds,
        "launch_calls_per_step": launches / rounds,
        "gpu_busy_us_per_step": busy_microseconds(intervals) / rounds,
        "kernel_sum_us_per_step": sum(b - a for a, b in intervals) / rounds,
        "top_kernels": sorted(
            ((name, count / rounds, us / rounds) for name, (count, us) in by_kernel.items()), key=lambda k: -k[2]
        )[:15],
        "top_host_ops": [(a.key, a.count / rounds, a.self_cpu_time_total / rounds) for a in top_host],
    }


def graph_replay_seconds(step: Any, warmup: int, rounds: int) -> float:
    """Seconds per step of two steps captured in one CUDA graph and replayed (median of ``rounds`` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
        step()
    device = torch.device("cuda")
    return median_seconds(graph.replay, device, warmup, rounds) / 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt2_small_arguments(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (host operations only)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_profile: skipped, no CUDA device here (it profiles GPU kernels); a smoke run on the CPU: "
            "python benchmarks/gpu_profile.py --device cpu --layers 2 --embd 64 --heads 2 --block 64 --vocab 256"
        )
        return
    config = gpt_config(args)
    model, buckets = model_buckets(config, device, 0, args.bucket_bytes)
    tokens = torch.randint(config.vocab_size, (args.batch, config.block_size + 1), device=device)

    def forward_backward() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()

    base = median_seconds(forward_backward, device, args.warmup, args.rounds)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "buckets": len(buckets),
        "forward_backward_s": base,
        "ranks": {},
    }
    print(f"device: {results['gpu']}, torch {torch.__version__}; {len(buckets)} buckets of {args.bucket_bytes} B")
    print(f"forward + backward: {base * 1e3:.2f} ms")
    for rank, graphs in [(rank, graphs) for rank in args.ranks for graphs in (False, True)]:
        algorithm = PowerGossip(rank=rank, tuning=PowerGossipTuning(cuda_graphs=graphs))
        step = bound_step(algorithm, buckets, device)
        wall = median_seconds(step, device, args.warmup, args.rounds)
        entry: dict[str, Any] = {"wall_s": wall, **profile_steps(step, args.rounds, device)}
        if not graphs:  # the whole step as one graph: what the kernels take without the host
            algorithm._nonfinite_peers = lambda step, policy, received: set()  # capture refuses the host read
            try:
                if device.type != "cuda":
                    raise RuntimeError("CUDA graphs need a CUDA device")
                entry["graph_s"] = graph_replay_seconds(step, args.warmup, args.rounds)
            except Exception as error:  # report why the capture failed; the other numbers stand
                entry["graph_error"] = f"{type(error).__name__}: {error}"[:500]
        label = f"rank {rank}, {'CUDA graphs per plan (the default)' if graphs else 'op by op'}"
        results["ranks"][label] = entry
        busy = entry["gpu_busy_us_per_step"] * 1e-6
        print(
            f"\n{label}: wall {wall * 1e3:.2f} ms ({100 * wall / base:.1f} % of forward + backward); "
            f"{entry['kernels_per_step']:.0f} kernels / {entry['launch_calls_per_step']:.0f} launch calls per step; "
            f"GPU busy {busy * 1e3:.2f} ms ({100 * busy / base:.1f} %), idle {100 * (1 - busy / wall):.0f} % of the "
            f"wall time (profiler on)"
        )
        if "graph_s" in entry:
            graph = entry["graph_s"]
            print(f"  the whole step as one CUDA graph: {graph * 1e3:.2f} ms per step ({100 * graph / base:.1f} %)")
        elif "graph_error" in entry:
            print(f"  CUDA graph capture failed: {entry['graph_error']}")
        print("  costliest kernels (per step: calls, us):")
        for name, count, us in entry["top_kernels"]:
            print(f"    {count:5.1f} {us:8.1f}  {name}")
        print("  costliest host operations (per step: calls, self CPU us, profiler on):")
        for name, count, us in entry["top_host_ops"]:
            print(f"    {count:5.1f} {us:8.1f}  {name}")
    print(f"\nshares are of forward + backward; wall times are medians of {args.rounds} rounds")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
