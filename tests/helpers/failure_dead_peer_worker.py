"""Worker: train a tiny model with DecentralizedDataParallel (ExactGossip on a ring); one rank may kill itself.

Usage (by tests/test_failures_dead_peer.py): python tests/helpers/failure_dead_peer_worker.py OUT_DIR BACKEND
KILL_RANK [STEPS]. KILL_RANK -1 is a healthy run (exchange timeout 60 s instead of 5 s: nothing is meant to time
out). The rank ``KILL_RANK`` writes ``OUT_DIR/killed_at`` (time.time()) and SIGKILLs itself at the top of step
``KILL_STEP``; every rank writes its pid to ``OUT_DIR/rank<r>.pid`` first, its standard error to
``OUT_DIR/rank<r>.stderr`` (tests/helpers/own_stderr.py) and, after closing, the names of its remaining threads to
``OUT_DIR/rank<r>.threads``. A survivor's error is not caught: it reaches the interpreter's top level, so the exit
code is non-zero.
"""

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gossip
import topologies
from helpers import own_stderr
from helpers.gloo_threads import thread_names_once_gloo_ended

TIMEOUT = 5.0  # with a rank killed: how soon the survivors must name it
HEALTHY_TIMEOUT = 60.0  # with none: nothing may time out, however loaded the machine (a peer slow to its first step)
KILL_STEP = 5


def main() -> None:
    out_dir, backend, kill_rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid> prints every thread's stack
    torch.set_num_threads(1)
    own_stderr.redirect(out_dir)
    comm = gossip.init(backend, timeout=TIMEOUT if kill_rank >= 0 else HEALTHY_TIMEOUT)
    (out_dir / f"rank{comm.rank}.pid").write_text(str(os.getpid()))
    own_stderr.name_by_rank(out_dir, comm.rank)
    torch.manual_seed(comm.rank)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = gossip.DecentralizedDataParallel(net, comm, topologies.ring(comm.size), gossip.ExactGossip())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        if step == KILL_STEP and comm.rank == kill_rank:
            (out_dir / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(16, 8)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.close()
    comm.close()
    # What still runs after close: the clean-exit test requires that no Gloo thread lives into interpreter teardown.
    (out_dir / f"rank{comm.rank}.threads").write_text("\n".join(thread_names_once_gloo_ended()))


if __name__ == "__main__":
    main()
