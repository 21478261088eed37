"""Worker: the "check once, then trust" exchange protocol on 6 Gloo ranks, pairs (0, 1), (2, 3) and (4, 5).

Usage (by tests/test_comm_protocol.py): python tests/helpers/protocol_worker.py OUT_DIR. Every rank counts the
per-tensor header rounds (handshakes) over nine exchanges: three with unchanged tensors (layout A), two after a
change made by both ends (B), then A, B, A, B, as PowerGossip's left and right products alternate. The tenth
exchange is predicted to carry A: pair (0, 1) changes a tensor on rank 0 only to a new layout, pair (2, 3) drifts
a step apart (rank 3 one exchange ahead), and in pair (4, 5) rank 4 alone sends and expects B, a layout checked
before but not the predicted one.
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
    a, b = [100, 7], [100, 9]
    for seq, sizes in enumerate([a] * 3 + [b] * 2 + [a, b, a, b]):
        received = [torch.empty(n) for n in sizes]
        sends = [(peer, torch.full((n,), float(comm.rank))) for n in sizes]
        comm.exchange(sends, [(peer, t) for t in received], seq=seq).wait()
        correct = correct and all(bool((t == peer).all()) for t in received)
    result = {"handshakes": list(handshakes), "correct": correct}
    seq = 9 + (comm.rank == 3)
    sizes = {0: [101, 7], 4: b}.get(comm.rank, a)
    try:
        received = [torch.empty(n) for n in (b if comm.rank == 4 else a)]
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
