"""Save a checkpoint on 2 simulated ranks at step 2, then SIGKILL this process in the middle of the next save.

Run as ``python checkpoint_kill_worker.py DIR``: writes ``DIR/ckpt/rank<r>.pt`` (step 2), then ``DIR/before.txt``
(the SHA-256 of each file), then starts a second save at step 3 whose write kills the whole process once part
of rank 1's temporary file is on disk. Used by tests/test_failures_checkpoint.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gossip
import gossip.checkpoint.file_format
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap

KILL_AFTER_BYTES = 256


def main(root: Path) -> None:
    directory = root / "ckpt"
    real_write = gossip.checkpoint.file_format._HashingWriter.write

    def write_then_die(self, data) -> int:
        written = real_write(self, data)
        if threading.current_thread().name == "sim-rank-1" and self.size > KILL_AFTER_BYTES:
            self.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # a rank killed in the middle of writing its checkpoint
        return written

    def rank(comm) -> None:
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            if step == 2:
                gossip.save_checkpoint(directory, model, optimizer)
                comm.barrier()
                if comm.rank == 0:
                    digests = [hashlib.sha256((directory / f"rank{r}.pt").read_bytes()).hexdigest() for r in (0, 1)]
                    (root / "before.txt").write_text("\n".join(digests))
                    gossip.checkpoint.file_format._HashingWriter.write = write_then_die
                comm.barrier()
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        gossip.save_checkpoint(directory, model, optimizer)  # never returns: rank 1 kills the process
        model.close()

    gossip.simulate(2, rank)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
