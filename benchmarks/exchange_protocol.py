"""The torch.distributed exchange protocol, before and after "check once, then trust", side by side on Gloo.

Before (git revision ``--baseline``, default the last one with the old protocol): every exchange sends one header
per tensor, waits for the peer's headers, reads them on the host, then posts the payload receives and sends.
After (this checkout): per-tensor headers only at the first exchange with a peer and when the tensors are not laid
out as the pair's earlier exchanges predict (a cycle of layouts, like PowerGossip's alternating left and right
products, settles once it has repeated); otherwise one steady header per peer, posted in one ``batch_isend_irecv``
with every payload. ``--baseline 09336fd`` compares with the first "check once" protocol, which re-checked every
change of layout, so every exchange of an alternating message.

Both run on the same process group: the old ``_start_exchange`` is loaded from the baseline revision and bound to
the communicator of this checkout, and the two alternate exchange by exchange (every rank in the same order; which
one goes first alternates by round), so they see the same machine load. Per message shape, the median exchange
time (start to ``wait``, max over ranks), the ratio of the medians old / new (> 1: the new protocol is faster) and
the median of the ratios of adjacent old and new exchanges ("paired", less sensitive to load that drifts during the
run) are printed.

Usage::

    python benchmarks/exchange_protocol.py --nprocs 4       # 4 Gloo processes on loopback, one-peer hypercube
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from baseline_revision import module_at_revision  # noqa: E402

import gossip  # noqa: E402
import topologies  # noqa: E402

BASELINE_REVISION = "40b881d"  # the last revision with a header round trip on every exchange
# name -> the layouts, each a list of tensor sizes (float32 elements) sent to the step's peer, taken in turn by each
# protocol's exchanges with that peer
SHAPES = {
    "PowerGossip message (2 tensors, 40 KB)": [[9_000, 1_000]],
    "PowerGossip, left/right alternating (1 tensor, 42/33 KB)": [[10_500], [8_200]],
    "exact gossip, main job (1 tensor, 1.7 MB)": [[440_000]],
    "20 small tensors (20 x 4 KB)": [[1_024] * 20],
    "one bucket (1 tensor, 25 MB)": [[6_553_600]],
}


def old_exchange(comm: gossip.Communicator, revision: str) -> types.MethodType:
    """The baseline revision's ``TorchDistCommunicator._start_exchange``, bound to ``comm``."""
    module = module_at_revision("gossip/backends/torch_dist.py", revision, "torch_dist_baseline")
    comm._agreed = {}  # the state of the revisions that re-checked every change of layout (before 2026-11-23)
    return types.MethodType(module.TorchDistCommunicator._start_exchange, comm)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    comm = gossip.init("gloo", timeout=60.0)
    schedule = topologies.one_peer_hypercube(comm.size)
    protocols = {"old": old_exchange(comm, args.baseline), "new": comm._start_exchange}
    times: dict[tuple[str, str], list[float]] = {}
    seq = 0
    shapes = {name: sizes for name, sizes in SHAPES.items() if args.only in name}
    for name, layouts in shapes.items():
        met: dict[tuple[str, int], int] = {}  # exchanges so far per (protocol, peer)
        for round_ in range(args.warmup + args.rounds):
            order = list(protocols.items())
            for label, start in order if round_ % 2 == 0 else order[::-1]:  # who goes first alternates
                (peer, _), *_ = schedule.peers(comm.rank, seq).in_peers
                count = met[label, peer] = met.get((label, peer), -1) + 1
                sizes = layouts[count % len(layouts)]
                sends = [(peer, torch.full((n,), float(comm.rank))) for n in sizes]
                recvs = [(peer, torch.empty(n)) for n in sizes]
                plan = gossip.backends.base.plan_transfers
                outgoing = plan(sends, "send to", comm.rank, comm.size, comm.device)
                incoming = plan(recvs, "receive from", comm.rank, comm.size, comm.device)
                comm.barrier()
                began = time.perf_counter()
                start(outgoing, incoming, seq).wait()
                elapsed = time.perf_counter() - began
                assert all(bool((t == peer).all()) for _, t in recvs), "wrong data received"
                seq += 1
                if round_ >= args.warmup:
                    times.setdefault((name, label), []).append(elapsed)
    gathered = comm.all_gather_object(times)
    if comm.rank == 0:
        print(f"Gloo, {comm.size} processes on loopback, one-peer hypercube; median over {args.rounds} exchanges "
              f"of the slowest rank; baseline revision {args.baseline}")  # fmt: skip
        print(f"{'message':<58} {'old ms':>8} {'new ms':>8} {'old / new':>10} {'paired':>7}")
        for name in shapes:
            slowest = {
                label: [max(values) for values in zip(*(g[(name, label)] for g in gathered), strict=True)]
                for label in protocols
            }
            median = {label: statistics.median(values) for label, values in slowest.items()}
            paired = statistics.median(o / n for o, n in zip(slowest["old"], slowest["new"], strict=True))
            print(f"{name:<58} {median['old'] * 1e3:8.3f} {median['new'] * 1e3:8.3f} "
                  f"{median['old'] / median['new']:10.2f} {paired:7.2f}")  # fmt: skip
    comm.close()


def spawn(nprocs: int, argv: list[str]) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank))
        env.update(LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--nprocs=0"], env=env))
    return max(proc.wait() for proc in procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=0, help="spawn this many local processes (loopback)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--baseline", default=BASELINE_REVISION)
    parser.add_argument("--only", default="", help="measure only the messages whose name contains this text")
    args = parser.parse_args()
    if args.nprocs:
        sys.exit(spawn(args.nprocs, sys.argv[1:]))
    run(args)


if __name__ == "__main__":
    main()
