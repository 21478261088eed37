"""Memory per rank of gossip on sharded replicas against unsharded gossip of the same replicas, in one run.

Up to three jobs of local Gloo processes, one after the other, each training the same GPT (``gossip.app.gpt``) a
few steps on random bytes, mixed as ``--mixing`` says (the default pipeline: PowerGossip, sign trackers,
``optim.MomentumTrackingAdamW``; or exact gossip and AdamW):

* ``unsharded``: R ranks, one replica each, :class:`gossip.DecentralizedDataParallel`;
* ``sharded``: R x G ranks, each replica built on the meta device, sharded by FSDP2 (``fully_shard`` over
  ``mesh["shard"]``), materialised shard by shard (``to_empty``, then GPT-2's initialisation on the local shards)
  and mixed by :class:`gossip.ShardedDecentralizedDataParallel` (``gossip.init_lanes``);
* ``fsdp-only``: the same sharded replicas with FSDP2 alone, never mixed: what the gossip wrapper adds to a sharded
  rank is the difference to ``sharded``.

After the last step (gradients set to None) every rank counts the bytes of the live tensor storages of its process
(every tensor ``gc`` can reach, each storage once; a DTensor by its local tensor), split into the parameters (a
sharded rank: the storages of its local shards, FSDP2's padded ones), the optimizer state, and the rest (the
wrappers' staging and receive buffers, FSDP2's buffers, the batch); and the growth of its peak resident set size
from just before the model is built (``getrusage``'s ``ru_maxrss``; it includes the transient all-gathered
parameters and the activations of forward and backward, and the allocator's slack), once built and after each
step. The launcher prints one row per rank, the means per job side by side and their ratios to the unsharded job's.
With G shards, parameters and optimizer state per rank are expected at about 1/G of the unsharded rank's (FSDP2
pads each parameter's dim 0 to a multiple of G).

    python benchmarks/sharded_memory.py --replicas 2 --shards 2 --layers 4 --embd 512 --steps 8
    python benchmarks/sharded_memory.py --mixing exact          # exact gossip and AdamW
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
#: the jobs: unsharded gossip, gossip of FSDP2-sharded replicas, and FSDP2 alone (no gossip; the wrapper's share)
JOBS = ("unsharded", "sharded", "fsdp-only")
SHARDED_JOBS = ("sharded", "fsdp-only")


def _storage_key(tensor: Any) -> tuple[int, int] | None:
    """(address, bytes) of the storage under ``tensor`` (a DTensor's local tensor), or None for no storage."""
    local = getattr(tensor, "_local_tensor", tensor)
    try:
        storage = local.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if storage.device.type == "meta" or storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def storage_bytes(tensors: Any) -> dict[int, int]:
    """The distinct storages under ``tensors``: address -> bytes."""
    found: dict[int, int] = {}
    for tensor in tensors:
        key = _storage_key(tensor)
        if key is not None:
            found[key[0]] = key[1]
    return found


def live_storages() -> dict[int, int]:
    """Every storage under a tensor ``gc`` tracks in this process: address -> bytes."""
    import torch

    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some module objects reads a deprecated torch attribute
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return storage_bytes(tensors)


def optimizer_tensors(optimizer: Any) -> list[Any]:
    """The tensors of an optimizer's per-parameter state."""
    import torch

    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def rss_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def initialise_shards(net: Any) -> None:
    """GPT-2's initialisation on the local shards: N(0, 0.02) for matrices and embeddings, LayerNorm weights 1,
    biases 0 (the wrapper then copies replica 0's shards to every replica)."""
    import torch

    with torch.no_grad():
        for name, parameter in net.named_parameters():
            local = parameter.to_local()
            if local.ndim >= 2:
                local.normal_(0.0, 0.02)
            elif name.endswith("weight"):
                local.fill_(1.0)
            else:
                local.zero_()


def worker(args: argparse.Namespace) -> None:
    """One rank of one job: build, train ``args.steps`` steps, count, write ``args.result``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gossip
    import topologies
    from gossip.app.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    comm = gossip.init("gloo", timeout=300.0)
    replicas = comm.size if args.mode == "unsharded" else comm.size // args.shards
    baseline_rss = rss_bytes()
    torch.manual_seed(0)
    config = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    schedule = topologies.by_name(gossip.default_schedule(replicas), replicas)
    lanes = None
    if args.mode in SHARDED_JOBS:
        with torch.device("meta"):  # as a model that does not fit one rank is built: no full copy at any time
            net = GPT(config)
        mesh = init_device_mesh("cpu", (replicas, args.shards), mesh_dim_names=("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(net, mesh=mesh["shard"], reshard_after_forward=True)
        net.to_empty(device="cpu")
        initialise_shards(net)
        replica = int(mesh.get_coordinate()[0])
        model: Any = net  # fsdp-only: FSDP2 alone, the replicas never mix (what the wrapper adds is the difference)
        if args.mode == "sharded":
            lanes = gossip.init_lanes(mesh, timeout=300.0)
            algorithm, tracking = mixing(args)
            model = gossip.ShardedDecentralizedDataParallel(net, lanes, schedule, algorithm, **tracking)
    else:
        net = GPT(config)
        algorithm, tracking = mixing(args)
        model = gossip.DecentralizedDataParallel(net, comm, schedule, algorithm, **tracking)
        replica = comm.rank
    wrapped_peak = peak_rss_bytes()
    pipeline = args.mixing == "pipeline" and args.mode != "fsdp-only"
    optimizer = (
        gossip.Pipeline().optimizer(model.parameters(), lr=1e-4)
        if pipeline
        else torch.optim.AdamW(model.parameters(), lr=1e-4)
    )
    step_peaks = []
    generator = torch.Generator().manual_seed(replica)  # the shards of a replica read the same batch
    for _ in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.block + 1), generator=generator)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_peaks.append(peak_rss_bytes())
    live = live_storages()
    parameters = storage_bytes(model.parameters())
    state = storage_bytes(optimizer_tensors(optimizer))
    result = {
        "mode": args.mode,
        "rank": comm.rank,
        "replica": replica,
        "parameter_count": sum(p.numel() for p in net.parameters()),
        "parameters_bytes": sum(parameters.values()),
        "optimizer_state_bytes": sum(state.values()),
        "other_live_bytes": sum(b for address, b in live.items() if address not in parameters and address not in state),
        "live_bytes": sum(live.values()),
        "peak_rss_growth_bytes": peak_rss_bytes() - baseline_rss,
        "peak_rss_growth_built_bytes": wrapped_peak - baseline_rss,
        "peak_rss_growth_by_step_bytes": [peak - baseline_rss for peak in step_peaks],
        "final_loss": loss.item(),
    }
    if model is not net:
        model.close()
    if lanes is not None:
        lanes.lane.close()
        lanes.shard.close()
    comm.close()
    Path(args.result).write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(mode: str, ranks: int, args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """Start ``ranks`` workers of ``mode`` on a free loopback port, wait, return their results in rank order."""
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.update({"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1"})
    env["MASTER_PORT"] = port
    passed = ["--shards", str(args.shards), "--layers", str(args.layers), "--embd", str(args.embd)]
    passed += ["--heads", str(args.heads), "--block", str(args.block), "--batch", str(args.batch)]
    passed += ["--steps", str(args.steps), "--mixing", args.mixing]
    procs = []
    for rank in range(ranks):
        result = scratch / f"{mode}_rank{rank}.json"
        command = [sys.executable, __file__, "--worker", mode, "--result", str(result), *passed]
        procs.append(subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    codes = [proc.wait(timeout=args.timeout) for proc in procs]
    if any(codes):
        raise SystemExit(f"{mode}: worker exit codes {codes}")
    return [json.loads((scratch / f"{mode}_rank{rank}.json").read_text()) for rank in range(ranks)]


COLUMNS = ("parameters_bytes", "optimizer_state_bytes", "other_live_bytes", "live_bytes", "peak_rss_growth_bytes")


def report(jobs: dict[str, list[dict[str, Any]]], shards: int) -> None:
    """One row per rank, then the means per job and their ratios to the unsharded job's."""
    header = ["job", "rank", "replica", *[name.removesuffix("_bytes") + " MiB" for name in COLUMNS]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * 3 + "---:|" * len(COLUMNS))
    for rows in jobs.values():
        for row in rows:
            cells = [row["mode"], str(row["rank"]), str(row["replica"])]
            print("| " + " | ".join(cells + [f"{row[name] / MIB:.1f}" for name in COLUMNS]) + " |")
    means = {name: {c: sum(row[c] for row in rows) / len(rows) for c in COLUMNS} for name, rows in jobs.items()}
    for name in jobs:
        print("| " + " | ".join([f"{name}, mean", "", ""] + [f"{means[name][c] / MIB:.1f}" for c in COLUMNS]) + " |")
    for name in jobs:
        if name != "unsharded":
            ratios = [means[name][c] / means["unsharded"][c] for c in COLUMNS]
            print("| " + " | ".join([f"{name} / unsharded", "", ""] + [f"{ratio:.3f}" for ratio in ratios]) + " |")
    print(f"(1/G = {1 / shards:.3f}; parameters: {jobs['unsharded'][0]['parameter_count']:,})")
    for name, rows in jobs.items():
        built = sum(row["peak_rss_growth_built_bytes"] for row in rows) / len(rows) / MIB
        steps = [
            sum(column) / len(rows) / MIB
            for column in zip(*(row["peak_rss_growth_by_step_bytes"] for row in rows), strict=True)
        ]
        after = " / ".join(f"{value:.1f}" for value in steps)
        print(f"{name}: peak RSS growth, mean over ranks, once built (model, wrapper): {built:.1f} MiB; ", end="")
        print(f"after each step: {after} MiB")


def mixing(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The wrapper's algorithm (and trackers): exact gossip, or the default pipeline's PowerGossip and sign trackers
    (its optimizer, ``optim.MomentumTrackingAdamW``, then replaces AdamW)."""
    import gossip

    if args.mixing == "exact":
        return gossip.ExactGossip(), {}
    pipeline = gossip.Pipeline()
    return pipeline.algorithm(), {"gradient_tracking": pipeline.tracking()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mixing", choices=("exact", "pipeline"), default="pipeline",
                        help="exact gossip with AdamW, or the default pipeline (PowerGossip, sign trackers, "
                        "MomentumTrackingAdamW); fsdp-only always runs AdamW alone")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS), help="which jobs, in this order")
    parser.add_argument("--worker", choices=JOBS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.mode = args.worker
        worker(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        jobs = {
            job: run_job(job, args.replicas * (1 if job == "unsharded" else args.shards), args, Path(scratch))
            for job in ("unsharded", *[job for job in args.jobs if job != "unsharded"])
        }
    report(jobs, args.shards)


if __name__ == "__main__":
    main()
