"""Worker: two Gloo ranks exchange once; rank 1 then SIGKILLs itself and rank 0 exchanges with it again.

Usage (by tests/test_failures_send_to_dead.py): python tests/helpers/failure_send_to_dead_worker.py OUT_DIR. Rank 0
waits until rank 1 is dead (its pid gone), so its send is refused by Gloo when it is posted (the connection is closed),
and writes what the second exchange raised to ``OUT_DIR/error.txt``.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

import gossip


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, or a process already reaped, does not)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    comm = gossip.init("gloo", timeout=10.0)
    peer = 1 - comm.rank
    received = torch.empty(4)
    comm.exchange([(peer, torch.ones(4))], [(peer, received)], seq=0).wait()
    if comm.rank == 1:
        written = out_dir / "rank1.pid.partial"
        written.write_text(str(os.getpid()))
        written.replace(out_dir / "rank1.pid")  # atomic: rank 0 never reads a half-written file
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while not (out_dir / "rank1.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((out_dir / "rank1.pid").read_text())
    while running(pid):
        time.sleep(0.05)
    time.sleep(0.5)  # let Gloo notice the closed connection
    try:
        comm.exchange([(peer, torch.ones(4))], [(peer, received)], seq=1).wait()
        error = "no error"
    except BaseException as caught:
        error = f"{type(caught).__name__}: {caught}"
    (out_dir / "error.txt").write_text(error)
    sys.stdout.flush()
    os._exit(0)  # the process group holds a dead connection: skip Gloo's teardown


if __name__ == "__main__":
    main()
