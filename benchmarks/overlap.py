"""Overlap benchmark: how much of the communication time a training step actually waits for.

Runs, side by side in one job on every rank (same model, same batch size, same data, SGD unless said otherwise):

* ``local``  -- no communication at all: the compute-only step time (``local-adamw``: the same with AdamW, run
  when a momentum-tracking method is, whose optimizer is an AdamW).
* ``exact`` / ``powergossip`` / ``allreduce`` -- DecentralizedDataParallel with that algorithm (one-peer hypercube
  schedule). Exposed communication = the time the step blocks inside ``finish`` waiting on the exchange
  (the handles' ``wait_seconds``, logged per step by the wrapper). Communication time = the same exchange run
  blocking with no computation in between (``algorithm.step``, i.e. ``start`` then ``finish``), timed separately.
* ``mt-exact`` / ``mt-pg`` -- momentum tracking as the main job runs it (``--gradient-tracking exact --optimizer
  momentum-tracking-adamw``, the mean gradient's second moment every 32 steps) with exact gossip or the main job's
  PowerGossip for the parameters; ``mt-sign`` the latter with the trackers mixed by ``gossip.ChocoSign``
  (``--gradient-tracking sign``) and the second moment every 64 steps. The trackers' blocking exchange and the
  all-reduce of the sampled steps are booked to the same ``wait_seconds``, so they count as exposed; the
  communication time adds the trackers' exchange run blocking.
* ``default`` -- the library's default pipeline exactly as ``gossip.wrap`` builds it (``gossip.Pipeline()``:
  PowerGossip rank 4, ChocoSign trackers, ``optim.MomentumTrackingAdamW`` with the gossiped mean gradient),
  read against ``local-adamw``, run with it. ``previous-defaults``: the main job's defaults before it
  (``gossip-train --outer-every 10``: the main job's PowerGossip and an exact average every 10 steps).
* ``ddp`` -- torch ``DistributedDataParallel`` on the Gloo process group (bucketed gradient all-reduce overlapped
  with backward). Its waiting is not observable from outside, so: exposed = DDP step time - local step time;
  communication time = a blocking ``all_reduce`` of a flat tensor of the gradients' size, timed separately.

Reported per method (means over measured steps, then over ranks): step time, communication time, exposed
communication, and exposed / communication (0 = fully hidden behind forward and backward, 1 = not at all), plus
the step time minus the local one (everything the method costs: exposed communication, mixing arithmetic, and
CPU contention from the communication threads when ranks share cores). For DDP the last two coincide by
construction, so its fraction can exceed 1 when its overhead is more than a blocking all-reduce.
With ``--rounds R`` every method is measured R times (every other round in reverse order) and each method's step
over the same round's compute-only step is printed as a median and range, also for the process's CPU seconds per
step (all its threads), which other processes' load on a shared machine does not inflate.
For the gossip methods also "peer late": per step, how long after this rank its latest in-peer of that step (every
rank on an averaging step) ended backward, by one wall clock; and "exposed of it": the part of each step's wait
no longer than that lateness, the wait a late peer accounts for rather than the transfer. For the compute-only step
each rank's mean, standard deviation and 90th percentile: the step-to-step spread that makes a peer late.

Usage::

    python benchmarks/overlap.py --nprocs 4                   # spawns 4 Gloo processes on loopback
    python benchmarks/overlap.py --nprocs 4 --model gpt --batch 16 --methods default --rounds 5   # paired rounds
    python -m experiments.netem run --hosts 4 --rate 100mbit -- python benchmarks/overlap.py
    torchrun --nproc-per-node 4 benchmarks/overlap.py

Under a launcher the script reads the torchrun-style environment through ``gossip.init``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import gossip  # noqa: E402
import topologies  # noqa: E402
from gossip.algorithms.allreduce import AllReduce  # noqa: E402
from gossip.algorithms.exact import ExactGossip  # noqa: E402
from gossip.wrapper.parallel import DecentralizedDataParallel  # noqa: E402


class Method(NamedTuple):
    """How one gossip row of the table trains: its algorithm, the wrapper's gradient tracking, its optimizer."""

    make_algorithm: Callable[[], object]
    gradient_tracking: object = False
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = lambda model: torch.optim.SGD(
        model.parameters(), lr=0.01
    )
    #: a whole pipeline (``gossip.Pipeline``) that builds the wrapper and its optimizer itself; the fields above
    #: are then unused
    pipeline: object = None


def momentum_tracking(algorithm: str, size: int, trackers: str = "exact", every: int = 32) -> Method:
    """The main job's momentum tracking with ``algorithm`` for the parameters, on the one-peer hypercube, its
    trackers mixed by ``trackers`` (``--gradient-tracking``) and the mean gradient's second moment every ``every``
    steps."""
    from gossip.app.train import (
        MOMENTUM_TRACKING,
        TrainConfig,
        make_algorithm,
        make_optimizer,
        resolve,
        tracking_option,
    )

    given = TrainConfig(
        algorithm=algorithm,
        schedule="one_peer_hypercube",
        outer_every=0,
        gradient_tracking=trackers,
        optimizer=MOMENTUM_TRACKING,
        second_moment_every=every,
    )
    config = resolve(given, size)[0]
    return Method(lambda: make_algorithm(config), tracking_option(config), lambda model: make_optimizer(config, model))


def algorithms(size: int) -> dict[str, Method]:
    found: dict[str, Method] = {"exact": Method(ExactGossip), "allreduce": Method(AllReduce)}
    # the library's default pipeline exactly as gossip.wrap builds it (PowerGossip rank 4, ChocoSign trackers,
    # MomentumTrackingAdamW with the gossiped mean gradient's second moment every 64 steps)
    found["default"] = Method(ExactGossip, pipeline=gossip.Pipeline())
    # the same with the trackers mixed twice a step (tracker_hops=2, the default pipeline's from 9 to 16 ranks)
    found["default-two-hops"] = Method(ExactGossip, pipeline=gossip.Pipeline(tracker_hops=2))
    try:
        from gossip.algorithms.powergossip import PowerGossip

        found["powergossip"] = Method(lambda: PowerGossip(rank=1))
        from gossip.algorithms.powergossip import PowerGossipTuning

        # the main job's PowerGossip (rank 4, 2 power iterations, float16 products), whose second iteration runs
        # during backward once the first has arrived (bit-identical); the same with every iteration after the first
        # run in the optimizer step (the defaults before iterations_during_backward); and with its second iteration
        # applied at the next step, so that its exchange overlaps that step's forward and backward
        found["pg-defaults"] = Method(lambda: PowerGossip(rank=4, num_iterations=2, message_dtype=torch.float16))
        found["pg-in-finish"] = Method(
            lambda: PowerGossip(
                rank=4,
                num_iterations=2,
                message_dtype=torch.float16,
                tuning=PowerGossipTuning(iterations_during_backward=False),
            )
        )
        found["pg-delayed"] = Method(
            lambda: PowerGossip(rank=4, num_iterations=2, message_dtype=torch.float16, delayed_last_iteration=True)
        )
        # the main job's defaults before the pipeline (`gossip-train --outer-every 10`): that PowerGossip every step
        # and an exact average of the replicas every 10 steps (an outer step, lr 1, no momentum, over an all-reduce)
        from gossip.app.train import TrainConfig, make_algorithm, resolve

        previous = TrainConfig(outer_every=10)
        found["previous-defaults"] = Method(lambda: make_algorithm(resolve(previous, size)[0]))
        found["mt-exact"] = momentum_tracking("exact", size)
        found["mt-pg"] = momentum_tracking("powergossip", size)
        found["mt-sign"] = momentum_tracking("powergossip", size, trackers="sign", every=64)
    except ImportError:
        pass
    return found


def method_names(methods: str) -> list[str]:
    """The names of a ``--methods`` list, each one this benchmark measures (the gossip methods of
    :func:`algorithms` and ``ddp``), or a ValueError naming the unknown ones and the known."""
    names = methods.split(",")
    known = [*algorithms(2), "ddp"]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
    from gossip.app.gpt import GPT

    return GPT()


def make_batches(name: str, model: nn.Module, batch: int, rank: int, count: int) -> list[tuple]:
    generator = torch.Generator().manual_seed(rank)
    if name == "mlp":
        return [(torch.randn(batch, 784, generator=generator), torch.randint(10, (batch,))) for _ in range(count)]
    config = model.config
    tokens = [
        torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=generator) for _ in range(count)
    ]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_fn(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    logits = out[0] if isinstance(out, tuple) else out
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_steps(model: nn.Module, name: str, batches: list[tuple], adamw: bool = False, warmup: int = 0) -> list[float]:
    """Ordinary SGD (or AdamW) loop; returns each step's wall time (the first ``warmup`` are dropped by the caller)."""
    if adamw:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for index, (x, y) in enumerate(batches):
        if index == warmup:
            CPU_SECONDS[0] = time.process_time()
        begin = time.perf_counter()
        loss_fn(name, model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - begin)
    CPU_SECONDS[1] = (time.process_time() - CPU_SECONDS[0]) / max(1, len(batches) - warmup)
    return times


#: [process CPU seconds at the first measured step, CPU seconds per measured step] of the last loop measured: all
#: of the process's threads (its communication threads included), which the other processes' load does not inflate
CPU_SECONDS = [0.0, 0.0]


def posted_ahead(algorithm: object) -> int:
    """PowerGossip's power iterations posted during backward so far, also inside a composite (0 for others)."""
    inner = getattr(algorithm, "between", None) or getattr(algorithm, "inner", None) or algorithm
    return getattr(inner, "posted_ahead", 0)


def peer_lateness(comm, schedule, period, rows: list[dict], ready: list[float]) -> list[float]:
    """Per step, how long after this rank its latest in-peer finished backward (0 if none was later).

    ``ready`` holds each step's wall-clock time (``time.time()``, one clock for the processes of one host) at the end
    of backward. A wait no longer than this lateness is the peer's lateness (unequal or jittered compute, a
    descheduled process), not the transfer: no overlap can hide it, and DDP pays it too.
    """
    everyone = comm.all_gather_object(ready)
    late = []
    for index, row in enumerate(rows):
        step = int(row["step"])
        if period is not None and period.ends(step):
            peers = [j for j in range(comm.size) if j != comm.rank]
        else:
            peers = [j for j, _ in schedule.peers(comm.rank, step).in_peers]
        latest = max((everyone[j][index] for j in peers), default=ready[index])
        late.append(max(0.0, latest - ready[index]))
    return late


def measure_gossip(comm, args, method: Method, batches: list[tuple]) -> dict[str, float]:
    if method.pipeline is not None:
        model, optimizer = method.pipeline.wrap(make_model(args.model), comm, lr=3e-3, consensus_every=0)
        schedule = model.schedule
    else:
        schedule = topologies.one_peer_hypercube(comm.size)
        model = DecentralizedDataParallel(
            make_model(args.model),
            comm,
            schedule,
            method.make_algorithm(),
            consensus_every=0,
            gradient_tracking=method.gradient_tracking,
        )
        optimizer = method.make_optimizer(model)
    rows, ready, ahead_before = [], [], 0
    comm.barrier()
    for index, (x, y) in enumerate(batches):
        if index == args.warmup:
            ahead_before = posted_ahead(model.algorithm)
            cpu_begin = time.process_time()
        loss_fn(args.model, model, x, y).backward()
        ready.append(time.time())  # what this rank's peers wait for: its gradients, then its last message
        optimizer.step()
        optimizer.zero_grad()
        rows.append(dict(model.metrics.last))
    ahead = posted_ahead(model.algorithm) - ahead_before
    cpu = (time.process_time() - cpu_begin) / (len(batches) - args.warmup)
    model.close()
    period = getattr(model.algorithm, "period", None)
    late = peer_lateness(comm, schedule, period, rows, ready)[args.warmup :]
    blocking = []
    for k in range(args.comm_repeats):
        comm.barrier()
        begin = time.perf_counter()
        model.algorithm.step(model.step_count + 1 + k)
        model.algorithm.drain()  # a delayed last iteration: completed here, so it is timed too
        if model.tracker is not None:  # and the trackers' exchange (exact: one model-sized message)
            model.tracker.mixing.step(model.step_count + 1 + k)
        blocking.append(time.perf_counter() - begin)
    rows = rows[args.warmup :]
    # a composite's averaging steps apart from its gossip steps (0 where it has none)
    syncs = [r["wait_seconds"] for r in rows if period is not None and period.ends(int(r["step"]))]
    return {
        "exposed_on_averaging_steps": statistics.mean(syncs) if syncs else 0.0,
        "averaging_steps": len(syncs),
        "step": statistics.mean(r["step_seconds"] for r in rows),
        "cpu": cpu,
        "comm": statistics.median(blocking),
        "exposed": statistics.mean(r["wait_seconds"] for r in rows),
        # the part of each step's wait that its latest peer's lateness accounts for, and the lateness itself
        "exposed_peer_late": statistics.mean(min(r["wait_seconds"], d) for r, d in zip(rows, late, strict=True)),
        "peer_late": statistics.mean(late),
        "bytes_sent_per_step": statistics.mean(r["bytes_sent"] for r in rows),
        # power iterations posted during backward (PowerGossip.progress) per measured step
        "ahead_per_step": ahead / len(rows),
    }


def measure_ddp(comm, args, batches: list[tuple], local_step: float) -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel

    module = make_model(args.model)
    model = DistributedDataParallel(module)
    comm.barrier()
    step = statistics.mean(train_steps(model, args.model, batches)[args.warmup :])
    flat = torch.zeros(sum(p.numel() for p in module.parameters()))
    blocking = []
    for _ in range(args.comm_repeats):
        dist.barrier()
        begin = time.perf_counter()
        dist.all_reduce(flat)
        blocking.append(time.perf_counter() - begin)
    return {
        "step": step,
        "comm": statistics.median(blocking),
        "exposed": max(0.0, step - local_step),
        "bytes_sent_per_step": 2 * (comm.size - 1) / comm.size * flat.numel() * 4,
    }


def measure_round(comm, args, probe: nn.Module, batches: list[tuple], order: list[str]) -> dict[str, dict]:
    """One measurement of every name in ``order`` (``local``, ``local-adamw`` and the methods), in that order."""
    results: dict[str, dict] = {}
    wanted = algorithms(comm.size)
    for name in order:
        if name == "local":
            local_times = train_steps(probe, args.model, batches, warmup=args.warmup)[args.warmup :]
            # the compute-only step's own spread: how far apart unsynchronised ranks drift each step (the wait a
            # late peer causes comes from it, whatever the method)
            spread = {"step_sd": statistics.stdev(local_times), "step_p90": statistics.quantiles(local_times, n=10)[-1]}
            results["local"] = {"step": statistics.mean(local_times), "cpu": CPU_SECONDS[1], "comm": 0.0,
                                "exposed": 0.0, "bytes_sent_per_step": 0.0, **spread}  # fmt: skip
        elif name == "local-adamw":
            # momentum tracking's optimizer is an AdamW: its compute-only step, to read its "vs local" against
            times = train_steps(make_model(args.model), args.model, batches, adamw=True, warmup=args.warmup)
            results["local-adamw"] = {"step": statistics.mean(times[args.warmup :]), "cpu": CPU_SECONDS[1],
                                      "comm": 0.0, "exposed": 0.0, "bytes_sent_per_step": 0.0}  # fmt: skip
        elif name == "ddp":
            if comm.backend == "gloo":
                results["ddp"] = measure_ddp(comm, args, batches, results.get("local", {}).get("step", 0.0))
        elif name in wanted:
            results[name] = measure_gossip(comm, args, wanted[name], batches)
        comm.barrier()
    return results


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    comm = gossip.init(args.backend, timeout=600.0)
    probe = make_model(args.model)
    batches = make_batches(args.model, probe, args.batch, comm.rank, args.warmup + args.steps)
    methods = args.methods.split(",")  # checked by main (method_names)
    adamw = any(m.startswith(("mt-", "default")) for m in methods)
    order = ["local", *(["local-adamw"] if adamw else [])]
    order += [m for m in methods if m != "ddp"] + (["ddp"] if "ddp" in methods else [])  # ddp reads local's step
    tables = []
    for index in range(args.rounds):
        comm.barrier()
        # every other round in the reverse order (local first still: DDP's exposed time reads it), so that a
        # drifting load does not favour the methods measured first
        this = order if index % 2 == 0 else ["local", *reversed(order[1:])]
        gathered = comm.all_gather_object(measure_round(comm, args, probe, batches, this))
        if comm.rank == 0:
            tables.append(report(args, comm.size, sum(p.numel() for p in probe.parameters()), gathered))
    if comm.rank == 0 and args.rounds > 1:
        paired(tables)
    if comm.rank == 0 and args.out:
        rounds = {"rounds": tables} if args.rounds > 1 else tables[0]  # one round: the layout of earlier results
        Path(args.out).write_text(json.dumps({"args": vars(args), **rounds}, indent=2) + "\n")
    comm.close()


def paired(tables: list[dict]) -> None:
    """Each method's step over the compute-only steps of the same round, median over the rounds (and the range)."""
    print(f"\npaired over {len(tables)} rounds: step / compute-only step of the same round, median [min, max]")
    for reference in ("local", "local-adamw"):
        if reference not in tables[0]["results"]:
            continue
        for method in tables[0]["results"]:
            if method in ("local", "local-adamw"):
                continue
            ratios = [t["results"][method]["step"] / t["results"][reference]["step"] for t in tables]
            steps = [t["results"][method]["step"] * 1e3 for t in tables]
            line = (
                f"  {method:<18} / {reference:<12} {statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                f"{max(ratios):.3f}]   step {statistics.median(steps):.1f} ms"
            )
            if "cpu" in tables[0]["results"][method]:  # the same for the process's CPU seconds per step
                cpus = [t["results"][method]["cpu"] / t["results"][reference]["cpu"] for t in tables]
                line += f"   CPU {statistics.median(cpus):.3f} [{min(cpus):.3f}, {max(cpus):.3f}]"
                line += f" ({statistics.median(t['results'][method]['cpu'] for t in tables) * 1e3:.1f} ms)"
            print(line)


def report(args: argparse.Namespace, size: int, numel: int, gathered: list[dict]) -> dict:
    table = {}
    for method in gathered[0]:
        table[method] = {key: statistics.mean(r[method][key] for r in gathered) for key in gathered[0][method]}
    print(f"\n{args.model}: {numel / 1e6:.2f} M parameters, batch {args.batch}, {size} ranks, {args.steps} steps")
    local = table["local"]["step"]
    print(
        f"{'method':<18}{'step ms':>10}{'vs local ms':>13}{'comm ms':>10}{'exposed ms':>12}{'exposed/comm':>14}"
        f"{'MB sent/step':>14}{'ahead/step':>12}{'peer late ms':>14}{'exposed of it':>15}"
    )
    for method, row in table.items():
        fraction = row["exposed"] / row["comm"] if row["comm"] > 0 else float("nan")
        row["fraction"] = fraction
        print(
            f"{method:<18}{row['step'] * 1e3:>10.1f}{(row['step'] - local) * 1e3:>13.1f}{row['comm'] * 1e3:>10.1f}"
            f"{row['exposed'] * 1e3:>12.1f}"
            f"{fraction:>14.2f}{row['bytes_sent_per_step'] / 1e6:>14.2f}{row.get('ahead_per_step', 0.0):>12.2f}"
            f"{row.get('peer_late', 0.0) * 1e3:>14.1f}{row.get('exposed_peer_late', 0.0) * 1e3:>15.1f}"
        )

    def per_rank(key: str) -> str:
        return " ".join(f"{r['local'][key] * 1e3:.1f}" for r in gathered)

    print(f"local step per rank, ms: mean {per_rank('step')}, sd {per_rank('step_sd')}, p90 {per_rank('step_p90')}")
    return {"results": table, "local_per_rank": [r["local"] for r in gathered]}


def spawn(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.nprocs`` copies of this script on loopback with torchrun's environment."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    child_argv = [*argv, "--nprocs=0"]  # the last occurrence wins
    procs = []
    for rank in range(args.nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.nprocs), LOCAL_RANK=str(rank))
        env.update(LOCAL_WORLD_SIZE=str(args.nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *child_argv], env=env))
    return max(proc.wait() for proc in procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per method")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--comm-repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="measure everything this many times, interleaved")
    parser.add_argument("--methods", default="exact,powergossip,allreduce,ddp")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nprocs", type=int, default=0, help="spawn this many local processes (loopback)")
    parser.add_argument("--out", default="", help="write the table as JSON here (rank 0)")
    args = parser.parse_args()
    try:
        method_names(args.methods)
    except ValueError as error:
        parser.error(str(error))
    if args.nprocs:
        sys.exit(spawn(args, sys.argv[1:]))
    run(args)


if __name__ == "__main__":
    main()
