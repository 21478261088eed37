"""Worker of benchmarks/elastic.py and elastic_netem.py: exact gossip on one_peer_hypercube, elastic or not, timed.

Usage (under a launcher that hosts the membership store): ``elastic_worker.py OUT STEPS KILLS FLOATS ELASTIC
[MOMENTUM]``. Each step: a forward of ``x @ W`` with W a FLOATS-element float32 matrix (the model), backward,
optimizer step (SGD with MOMENTUM, default 0; the mixing). ELASTIC=1 runs ElasticRun on the elastic communicator;
ELASTIC=0 the plain torch.distributed communicator on the same kind of Gloo group, with a plain client of the same
store for the rendezvous (no membership thread). Writes OUT/rank<uid>.jsonl: one row per step with the wall time at
its end and the group of its mixing, then the membership events. A worker in KILLS (``RANK@STEP,...``) writes its
wall time and SIGKILLs itself at the top of that step. A worker started again with the same RANK joins the run
(elastic only) and writes OUT/rank<uid>.joined.jsonl, whose first row holds its start time, the times it asked to
join and was taken in, and its ``eth0`` byte counters then (``None`` where /sys has no eth0).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a joiner's start-up counts

import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from gossip import DecentralizedDataParallel, ExactGossip  # noqa: E402
from gossip.backends.elastic_comm import open_epoch  # noqa: E402
from gossip.backends.launch_env import LaunchInfo  # noqa: E402
from gossip.backends.membership import STORE_VARIABLE, connect  # noqa: E402
from gossip.backends.torch_dist import TorchDistCommunicator  # noqa: E402
from gossip.wrapper.elastic import schedule_for, solo_communicator  # noqa: E402
from gossip.wrapper.elastic_run import ElasticRun  # noqa: E402
from topologies import registry  # noqa: E402

TIMEOUT = 60.0


def wire_bytes() -> dict[str, int] | None:
    """Bytes received and sent on ``eth0`` so far (an emulated host's link), or None where there is none."""
    base = "/sys/class/net/eth0/statistics"
    if not os.path.isdir(base):
        return None
    return {key: int(open(f"{base}/{key}_bytes").read()) for key in ("rx", "tx")}


def plain_communicator(address: str, uid: int, size: int) -> TorchDistCommunicator:
    """The non-elastic Gloo communicator, its rendezvous on a plain client of the membership store."""
    host, port = address.rsplit(":", 1)
    client = torch.distributed.TCPStore(host, int(port), is_master=False,
                                        timeout=datetime.timedelta(seconds=TIMEOUT))  # fmt: skip
    info = LaunchInfo(rank=uid, size=size, local_rank=uid, local_size=size, launcher="none")
    return TorchDistCommunicator("gloo", info, None, TIMEOUT, store=torch.distributed.PrefixStore("plain/", client))


def main() -> None:
    out, steps, kills_text, floats, elastic_on = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
        sys.argv[5] == "1"  # fmt: skip
    momentum = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    kills = {int(r): int(s) for r, s in (item.split("@") for item in kills_text.split(",") if item)}
    uid, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    membership, holder, joining, first = None, [], False, {}
    if elastic_on:
        membership = connect(os.environ[STORE_VARIABLE], uid, timeout=TIMEOUT)
        joining = membership.joining
    if joining:  # restarted: a one-rank wrapper, then the hand-over from a neighbour
        comm, schedule = solo_communicator(TIMEOUT), schedule_for("one_peer_hypercube", 1)[0]
    elif elastic_on:
        comm = open_epoch(membership, 0, membership.current.members, TIMEOUT, lambda: holder[0].step_count)
        schedule = registry.by_name("one_peer_hypercube", size)
    else:
        comm = plain_communicator(os.environ[STORE_VARIABLE], uid, size)
        schedule = registry.by_name("one_peer_hypercube", size)
    side = math.isqrt(floats)
    torch.manual_seed(0)
    net = nn.Linear(side, side, bias=False)
    model = DecentralizedDataParallel(net, comm, schedule, ExactGossip(), consensus_every=0)
    holder.append(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=momentum)
    run = ElasticRun(model, optimizer, membership, schedule="one_peer_hypercube", algorithm=ExactGossip,
                     timeout=TIMEOUT) if elastic_on else None  # fmt: skip
    if joining:
        first = {"started": STARTED, "join_asked": time.time(), "wire_at_ask": wire_bytes()}
        run.join()
        first.update(joined=time.time(), wire_at_joined=wire_bytes())
    x = torch.randn(64, side, generator=torch.Generator().manual_seed(uid))
    with open(os.path.join(out, f"rank{uid}{'.joined' if joining else ''}.jsonl"), "w") as log:
        if joining:
            log.write(json.dumps(first) + "\n")
        while model.step_count < steps:
            step = model.step_count
            if run is not None:
                run.before_step()
            if kills.get(uid) == step:
                log.write(json.dumps({"killed_at": time.time(), "killed_step": step}) + "\n")
                log.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            model(x).square().mean().backward()
            if run is not None:
                run.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
            group = list(run.last_group) if run is not None else list(range(size))
            row = {"step": step, "t": time.time(), "group": group}
            if joining and len(group) > 1 and "wire" not in first:
                first["wire"] = row["wire"] = wire_bytes()  # after the first mixing step
            log.write(json.dumps(row) + "\n")
        if run is not None:
            run.finish()
            log.write(json.dumps({"events": run.events}) + "\n")
    model.close()
    if membership is not None:
        membership.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
