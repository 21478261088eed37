"""Worker: the "check once, then trust" exchange protocol on 4 Gloo ranks, pairs (0, 1) and (2, 3).

Usage (by tests/test_comm_protocol.py): python tests/helpers/protocol_worker.py OUT_DIR. Every rank counts the
per-tensor header rounds (handshakes) over five exchanges with unchanged tensors and over a change made by both ends;
then pair (0, 1) changes a tensor on rank 0 only and pair (2, 3) drifts a step apart (rank 3 one exchange ahead).
"""

import os
import sys
from pathlib import Path

import torch

import gossip


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    comm = gossip.init("gloo", timeout=10.0)
    handshakes: list[list[int]] = []
    original = comm._handshake
    comm._handshake = lambda peers, *args: (handshakes.append(list(peers)), original(peers, *args))[1]
    peer = comm.rank ^ 1
    correct = True
    for seq, sizes in enumerate([[100, 7]] * 5 + [[100, 9]] * 2):
        received = [torch.empty(n) for n in sizes]
        sends = [(peer, torch.full((n,), float(comm.rank))) for n in sizes]
        comm.exchange(sends, [(peer, t) for t in received], seq=seq).wait()
        correct = correct and all(bool((t == peer).all()) for t in received)
    result = {"handshakes": list(handshakes), "correct": correct}
    seq = 7 + (comm.rank == 3)
    sizes = [101, 9] if comm.rank == 0 else [100, 9]
    try:
        received = [torch.empty(100), torch.empty(9)]  # what every rank expects, as before
        sends = [(peer, torch.full((n,), float(comm.rank))) for n in sizes]
        comm.exchange(sends, [(peer, t) for t in received], seq=seq).wait()
        result["error"] = "no error"
    except gossip.GossipError as error:
        result["error"] = f"{type(error).__name__}: {error}"
    torch.save(result, out_dir / f"rank{comm.rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # a failed exchange leaves transfers inside Gloo: skip its teardown


if __name__ == "__main__":
    main()
