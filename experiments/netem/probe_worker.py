"""One rank of the network probe (run by probe.py inside a host namespace; Gloo via env://, or MPI).

Measures between ranks 0 and 1: the small-message half round trip (median over ``--pings`` ping-pongs of
``--ping-bytes``), and the bandwidth of one ``--bandwidth-mb`` message (time from the start of the send to
a 1-byte acknowledgement, best of ``--repeats``); then, over all ranks, the time of an all-reduce of
``--allreduce-mb`` of float32 (best of ``--repeats``, measured on rank 0 after a barrier).
Rank 0 prints one line ``NETEM_PROBE <json>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

RESULT_MARKER = "NETEM_PROBE"


def _median_half_round_trip(ping: Callable[[], None], count: int) -> float:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        ping()
        samples.append((time.perf_counter() - start) / 2.0)
    return statistics.median(samples)


def _best_time(action: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def _between_ranks_0_and_1(
    send: Callable[[Any, int], None],
    recv: Callable[[Any, int], None],
    rank: int,
    small: Any,
    large: Any,
    ack: Any,
    args: argparse.Namespace,
) -> dict[str, float]:
    """Ranks 0 and 1: the small message's median half round trip (ms) and one large message's bandwidth (Gbit/s),
    timed to the acknowledgement ``ack``; ``send(buffer, peer)`` and ``recv(buffer, peer)`` block."""

    def round_trip(there: Any, back: Any) -> None:
        if rank == 0:
            send(there, 1)
            recv(back, 1)
        else:
            recv(there, 0)
            send(back, 0)

    def ping() -> None:
        round_trip(small, small)

    def transfer() -> None:
        round_trip(large, ack)

    for _ in range(5):
        ping()
    half_rtt_ms = 1e3 * _median_half_round_trip(ping, args.pings)
    seconds = _best_time(transfer, args.repeats)
    return {"half_rtt_ms": half_rtt_ms, "bandwidth_gbit_s": 8 * large.nbytes / seconds / 1e9}


def probe_gloo(args: argparse.Namespace) -> dict[str, float] | None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    small = torch.zeros(args.ping_bytes // 4, dtype=torch.float32)
    large = torch.zeros(int(args.bandwidth_mb * 2**20) // 4, dtype=torch.float32)
    result: dict[str, float] = {}
    if rank < 2:
        result.update(_between_ranks_0_and_1(dist.send, dist.recv, rank, small, large, torch.zeros(1), args))
    buffer = torch.ones(int(args.allreduce_mb * 2**20) // 4, dtype=torch.float32)

    def all_reduce() -> None:
        dist.barrier()
        dist.all_reduce(buffer)

    result["allreduce_s"] = _best_time(all_reduce, args.repeats)
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else None


def probe_mpi(args: argparse.Namespace) -> dict[str, float] | None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    small = np.zeros(args.ping_bytes, dtype=np.uint8)
    large = np.zeros(int(args.bandwidth_mb * 2**20), dtype=np.uint8)
    result: dict[str, float] = {}
    if rank < 2:
        ack = np.zeros(1, dtype=np.uint8)
        result.update(_between_ranks_0_and_1(comm.Send, comm.Recv, rank, small, large, ack, args))
    _sleepy_barrier(comm)  # idle ranks must not busy-poll the 2 cores away from ranks 0, 1 and the forwarder
    buffer = np.ones(int(args.allreduce_mb * 2**20) // 4, dtype=np.float32)

    def all_reduce() -> None:
        comm.Barrier()
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)

    result["allreduce_s"] = _best_time(all_reduce, args.repeats)
    comm.Barrier()
    return result if rank == 0 else None


def _sleepy_barrier(comm: object) -> None:
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "mpi"), required=True)
    parser.add_argument("--ping-bytes", type=int, default=1024)
    parser.add_argument("--pings", type=int, default=50)
    parser.add_argument("--bandwidth-mb", type=float, default=64.0)
    parser.add_argument("--allreduce-mb", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    result = probe_gloo(args) if args.backend == "gloo" else probe_mpi(args)
    if result is not None:
        print(f"{RESULT_MARKER} {json.dumps(result)}", flush=True)
    if args.backend == "gloo":
        os._exit(0)  # avoids Gloo's occasional abort at interpreter exit (docs/design.md J)
    return 0  # MPI: let mpi4py call MPI_Finalize at exit, so mpiexec collects all output


if __name__ == "__main__":
    sys.exit(main())
