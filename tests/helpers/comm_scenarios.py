"""Communicator scenarios run unchanged on the simulator, on Gloo and on MPI with 4 ranks.

Each scenario takes a communicator and returns plain data (digests of received bytes, small tensors, error
messages). The tests compare every backend's results with the simulator's and check each against the
expected pattern, so a backend that is wrong in the same way as the oracle still fails.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch

import gossip

SIZES = (1, 1000, 65_537)
BIG_NUMEL = 16 * 1024 * 1024  # 64 MB of float32
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def pattern(src: int, dst: int, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: distinct per pair, exact in every dtype."""
    values = torch.arange(numel, dtype=torch.int64) % 251 + 1000 * src + 10 * dst
    return values.to(dtype=dtype, device=device)


def exchange_with_k_peers(comm: gossip.Communicator) -> dict[str, Any]:
    """Ranks send to r+1..r+k and receive from r-1..r-k, for k = 1..3, every size and dtype."""
    out: dict[str, Any] = {}
    r, n = comm.rank, comm.size
    for k in (1, 2, 3):
        for dtype in DTYPES:
            for numel in SIZES:
                dsts = [(r + d) % n for d in range(1, k + 1)]
                srcs = [(r - d) % n for d in range(1, k + 1)]
                sends = [(p, pattern(r, p, numel, dtype, comm.device)) for p in dsts]
                recvs = [(p, torch.empty(numel, dtype=dtype, device=comm.device)) for p in srcs]
                comm.exchange(sends, recvs, seq=k).wait()
                key = f"k={k} {dtype} n={numel}"
                out[key] = [digest(t) for _, t in recvs]
                out[key + " ok"] = all(torch.equal(t, pattern(p, r, numel, dtype, comm.device)) for p, t in recvs)
    return out


def exchange_64mb(comm: gossip.Communicator) -> dict[str, Any]:
    peer = comm.rank ^ 1
    received = torch.empty(BIG_NUMEL, device=comm.device)
    comm.exchange([(peer, pattern(comm.rank, peer, BIG_NUMEL, torch.float32, comm.device))], [(peer, received)]).wait()
    return {
        "digest": digest(received),
        "ok": torch.equal(received, pattern(peer, comm.rank, BIG_NUMEL, torch.float32, comm.device)),
    }


def several_tensors_per_peer(comm: gossip.Communicator) -> dict[str, Any]:
    peer = comm.rank ^ 1
    sends = [
        (peer, pattern(comm.rank, peer, 7, torch.float64, comm.device)),
        (peer, pattern(comm.rank, peer, 3, torch.int64, comm.device)),
    ]
    recvs = [
        (peer, torch.empty(7, dtype=torch.float64, device=comm.device)),
        (peer, torch.empty(3, dtype=torch.int64, device=comm.device)),
    ]
    comm.exchange(sends, recvs, seq=5).wait()
    return {"received": [t.cpu() for _, t in recvs]}


def collectives(comm: gossip.Communicator) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(comm.rank)
    floats = torch.randn(1000, generator=generator).to(comm.device)
    summed, averaged = floats.clone(), floats.clone()
    comm.all_reduce(summed, "sum")
    comm.all_reduce(averaged, "avg")
    ints = (torch.arange(10, dtype=torch.int64) * (comm.rank + 1)).to(comm.device)
    comm.all_reduce(ints)
    halves = torch.full((4,), 0.5 * (comm.rank + 1), dtype=torch.bfloat16, device=comm.device)
    comm.all_reduce(halves)
    shared = torch.full((5,), float(comm.rank), device=comm.device)
    comm.broadcast(shared, src=2)
    comm.barrier()
    return {
        "sum": summed.cpu(),
        "avg": averaged.cpu(),
        "ints": ints.cpu(),
        "bf16": halves.cpu(),
        "broadcast": shared.cpu(),
        "gathered": comm.all_gather_object({"rank": comm.rank, "name": f"r{comm.rank}"}),
        "local": (comm.local_rank, comm.local_size),
    }


def background_progress(comm: gossip.Communicator) -> dict[str, Any]:
    """Start a 16 MB exchange, then compute without calling into the communicator; record whether the
    exchange completed while the main thread was still computing (it cannot, if progress needs this thread)."""
    peer = comm.rank ^ 1
    numel = 4 * 1024 * 1024
    received = torch.empty(numel, device=comm.device)
    handle = comm.exchange(
        [(peer, pattern(comm.rank, peer, numel, torch.float32, comm.device))], [(peer, received)], seq=9
    )
    a = torch.randn(128, 128)
    iterations, deadline = 0, time.monotonic() + 60.0
    while not handle.done() and time.monotonic() < deadline:
        a = torch.tanh(a @ a)  # compute only; no communicator call in this loop
        iterations += 1
    completed_while_computing = handle.done()
    handle.wait()
    return {
        "completed_while_computing": completed_while_computing,
        "iterations": iterations,
        "ok": torch.equal(received, pattern(peer, comm.rank, numel, torch.float32, comm.device)),
    }


def failures(comm: gossip.Communicator) -> dict[str, Any]:
    """Ranks 0 and 1 each wait for the other, which never sends. Rank 3 sends float64 where rank 2 expects
    float32 and waits for a reply that never comes. Every rank ends with an unusable communicator, so this runs last."""
    out: dict[str, Any] = {}
    try:
        if comm.rank in (0, 1):
            # rank 0 gives up first; rank 1 may then see rank 0's exit instead of its own timeout
            timeout = 3.0 if comm.rank == 0 else 8.0
            comm.exchange([], [(1 - comm.rank, torch.empty(4, device=comm.device))], seq=11).wait(timeout=timeout)
        elif comm.rank == 2:
            comm.exchange([], [(3, torch.empty(10, device=comm.device))], seq=12).wait(timeout=10.0)
        else:
            sends, recvs = (
                [(2, torch.zeros(10, dtype=torch.float64, device=comm.device))],
                [(2, torch.empty(1, device=comm.device))],
            )
            comm.exchange(sends, recvs, seq=12).wait(timeout=3.0)
    except gossip.GossipError as error:
        out["error"] = f"{type(error).__name__}: {error}"
    try:
        comm.all_reduce(torch.zeros(1, device=comm.device))
    except gossip.GossipError as error:
        out["after"] = f"{type(error).__name__}: {error}"
    return out


SCENARIOS: dict[str, Callable[[gossip.Communicator], dict[str, Any]]] = {
    "exchange_with_k_peers": exchange_with_k_peers,
    "exchange_64mb": exchange_64mb,
    "several_tensors_per_peer": several_tensors_per_peer,
    "collectives": collectives,
    "background_progress": background_progress,
    "failures": failures,  # must stay last
}


def run_all(comm: gossip.Communicator) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        start = time.perf_counter()
        try:
            results[name] = scenario(comm)
            results[name]["seconds"] = time.perf_counter() - start
        except Exception as error:  # reported by the test of that scenario, not by the whole job
            results[name] = {"exception": f"{type(error).__name__}: {error}"}
    return results
