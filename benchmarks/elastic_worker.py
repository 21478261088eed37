"""Worker of benchmarks/elastic.py: exact gossip over one_peer_hypercube with a timed step, elastic or not.

Usage (under gossip.app.elastic_launch.launch_elastic): ``elastic_worker.py OUT STEPS KILLS FLOATS ELASTIC``.
Each step: a forward of ``x @ W`` with W a FLOATS-element float32 matrix (the model), backward, optimizer step (the
mixing). ELASTIC=1 runs ElasticRun on the elastic communicator; ELASTIC=0 the plain torch.distributed communicator
on the same kind of Gloo group. Writes OUT/rank<uid>.jsonl: one row per step with the wall time at its end and the
group of its mixing, then the membership events.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
import warnings

import torch
from torch import nn

from gossip import DecentralizedDataParallel, ExactGossip
from gossip.backends.elastic_comm import open_epoch
from gossip.backends.launch_env import LaunchInfo
from gossip.backends.membership import STORE_VARIABLE, connect
from gossip.backends.torch_dist import TorchDistCommunicator
from gossip.wrapper.elastic_run import ElasticRun
from topologies import registry

TIMEOUT = 30.0


def main() -> None:
    out, steps, kills_text, floats, elastic_on = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
        sys.argv[5] == "1"  # fmt: skip
    kills = {int(r): int(s) for r, s in (item.split("@") for item in kills_text.split(",") if item)}
    uid, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    membership = connect(os.environ[STORE_VARIABLE], uid, timeout=TIMEOUT)
    holder = []
    if elastic_on:
        comm = open_epoch(membership, 0, membership.current.members, TIMEOUT, lambda: holder[0].step_count)
    else:
        info = LaunchInfo(rank=uid, size=size, local_rank=uid, local_size=size, launcher="none")
        store = torch.distributed.PrefixStore("plain/", membership.store)
        comm = TorchDistCommunicator("gloo", info, None, TIMEOUT, store=store)
    side = math.isqrt(floats)
    torch.manual_seed(0)
    net = nn.Linear(side, side, bias=False)
    model = DecentralizedDataParallel(net, comm, registry.by_name("one_peer_hypercube", size), ExactGossip(),
                                      consensus_every=0)  # fmt: skip
    holder.append(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    run = ElasticRun(model, optimizer, membership, schedule="one_peer_hypercube", algorithm=ExactGossip,
                     timeout=TIMEOUT) if elastic_on else None  # fmt: skip
    x = torch.randn(64, side, generator=torch.Generator().manual_seed(uid))
    with open(os.path.join(out, f"rank{uid}.jsonl"), "w") as log:
        while model.step_count < steps:
            step = model.step_count
            if run is not None:
                run.before_step()
            if kills.get(uid) == step:
                os.kill(os.getpid(), signal.SIGKILL)
            model(x).square().mean().backward()
            if run is not None:
                run.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
            group = list(run.last_group) if run is not None else list(range(size))
            log.write(json.dumps({"step": step, "t": time.time(), "group": group}) + "\n")
        if run is not None:
            run.finish()
            log.write(json.dumps({"events": run.events}) + "\n")
    model.close()
    membership.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
