"""One worker of tests/test_elastic_processes.py: pure exact-gossip mixing of a 4-number replica, elastic.

Usage: ``elastic_worker.py OUT STEPS KILLS`` under gossip.app.elastic_launch.launch_elastic (KILLS: ``r@s,r@s``).
Worker RANK starts from x = [RANK, 10 RANK, 100 RANK, 1000 RANK]. Every step it writes one JSON line to
OUT/rank<uid>.jsonl with the step, the group its mixing ran over (uids in rank order; itself alone while behind), x
before the step and x after it. The update (SGD, lr 1, gradient set by hand) adds delta(uid, step), known to the
test, so after - delta is exactly what the mixing made of x. Every 7th step (every ELASTIC_WORKER_CONSENSUS_EVERY-th
when set) the row also has the consensus distance over the worker's group after the step (or None). A worker named
in KILLS SIGKILLs itself at the top of that step, after writing its x: its exchange of that step is already posted
(the kill lands mid-exchange). A worker started again with the same RANK joins the run (OUT/rank<uid>.joined.jsonl);
with ELASTIC_WORKER_AFTER_DEATH set it first waits for the launcher to report that RANK's exit (so the test can
start it early); with ELASTIC_WORKER_HOLD_AT=STEP the others wait at STEP until a join is asked (so that it lands
mid-run). With ELASTIC_WORKER_DIE_AT_FORMATION=UID:EPOCH:WHEN worker UID SIGKILLs itself when it arrives at the
formation of EPOCH's group: before it tells the others it is there (WHEN=before), or just after (WHEN=after: the
others may already form the Gloo group, which then waits for it until the timeout). ELASTIC_WORKER_DETECT sets the
seconds of silence after which a member is declared dead (10 by default). With
ELASTIC_WORKER_TRACKING=exact|powergossip|sign the optimizer steps on gradient trackers mixed that way (the update
then adds minus the tracker, not delta) and each row also has the worker's tracker y after the step; its gradient is
-delta(uid, step). With ELASTIC_WORKER_KILL_IN=tracker a worker named in KILLS dies inside that step's update
instead, after the parameters' mixing, as its trackers' exchange is about to be posted (its partner is then left
waiting for the trackers' message). With ELASTIC_WORKER_OPTIMIZER=momentum the optimizer is MomentumTrackingAdamW
(beta1 = BETA1; a sample of the mean gradient every ELASTIC_WORKER_SECOND_MOMENT_EVERY steps, none by default),
whose first moment the trackers mix, and each row also has the trackers' input (that first moment), the optimizer's
count of moment updates and of samples, the group size of its last sample and its sampled second moment. With
ELASTIC_WORKER_SLOW_TRACKER=UID@STEP worker UID sleeps SLOW_SECONDS before it posts its trackers' exchange of STEP
(a change then lands between its partner's post and its own). Each row has the wall-clock time the step ended.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import time
import warnings

import torch
from torch import nn
from torch.distributed import TCPStore

from gossip import Algorithm, DecentralizedDataParallel, ExactGossip
from gossip.backends.elastic_comm import open_epoch
from gossip.backends.membership import STORE_VARIABLE, connect
from gossip.wrapper.elastic import schedule_for, solo_communicator
from gossip.wrapper.elastic_run import ElasticRun
from optim import MomentumTrackingAdamW

TIMEOUT = 20.0
#: steps between two measurements of the consensus distance (ELASTIC_WORKER_CONSENSUS_EVERY overrides it)
CONSENSUS_EVERY = 7
#: MomentumTrackingAdamW's beta1 under ELASTIC_WORKER_OPTIMIZER=momentum
BETA1 = 0.9
#: seconds a worker named by ELASTIC_WORKER_SLOW_TRACKER waits before it posts its trackers' exchange
SLOW_SECONDS = 3.0


def delta(uid: int, step: int) -> torch.Tensor:
    """The update worker ``uid`` adds at ``step`` (distinct per worker: no two replicas stay equal)."""
    return torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64) * (uid + 1) * (1 + step % 3)


def own_client(address: str) -> TCPStore:
    """A store client of its own: a long wait on the membership's client would hold up its heartbeats."""
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))


def die_at_formation(membership, spec: str) -> None:
    """Make this worker die at the formation of an epoch's group, as ``spec`` (UID:EPOCH:WHEN) says."""
    if not spec or int(spec.split(":")[0]) != membership.uid:
        return
    _, epoch, when = spec.split(":")
    arrive = membership.await_group

    def await_group(decision):
        if decision.epoch == int(epoch):
            if when == "after":  # what await_group writes first: the others see this member arrive
                membership.store.set(f"e{epoch}/ready/{membership.uid}", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        arrive(decision)

    membership.await_group = await_group


def before_trackers_exchange(model: DecentralizedDataParallel, step: int, action) -> None:
    """Run ``action`` once, when this worker's trackers' exchange of ``step`` is first about to be posted (whichever
    algorithm object mixes the trackers then: each member set gets a fresh one)."""
    start, done = Algorithm.start, []

    def start_after_action(self, at: int):
        if self is model.tracker.mixing and at == step and not done:
            done.append(True)
            action()
        return start(self, at)

    Algorithm.start = start_after_action


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    kills = {int(r): int(s) for r, s in (item.split("@") for item in sys.argv[3].split(",") if item)}
    uid, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if os.environ.get("ELASTIC_WORKER_AFTER_DEATH"):  # a restart: wait until the launcher reported this uid's exit
        own_client(os.environ[STORE_VARIABLE]).wait([f"dead/{uid}"], datetime.timedelta(seconds=60))
    detect = float(os.environ.get("ELASTIC_WORKER_DETECT", "10"))  # seconds of silence that make a member dead
    membership = connect(os.environ[STORE_VARIABLE], uid, timeout=TIMEOUT, detect=detect)
    die_at_formation(membership, os.environ.get("ELASTIC_WORKER_DIE_AT_FORMATION", ""))
    holder = []
    net = nn.Linear(4, 1, bias=False).double()
    joining = membership.joining
    if joining:  # restarted: a one-rank wrapper, then the hand-over from a neighbour
        comm, schedule = solo_communicator(TIMEOUT), schedule_for("one_peer_hypercube", 1)[0]
    else:
        comm = open_epoch(membership, 0, membership.current.members, TIMEOUT, lambda: holder[0].step_count)
        schedule = schedule_for("one_peer_hypercube", size)[0]
    tracking = os.environ.get("ELASTIC_WORKER_TRACKING") or False
    model = DecentralizedDataParallel(  # an elastic run samples the mean gradient by all-reduce (skipped at a change)
        net, comm, schedule, ExactGossip(), consensus_every=0, gradient_tracking=tracking, mean_gradient="allreduce"
    )
    holder.append(model)
    with torch.no_grad():
        model.buckets[0].buffer.copy_(torch.tensor([1.0, 10.0, 100.0, 1000.0], dtype=torch.float64) * uid)
    if os.environ.get("ELASTIC_WORKER_OPTIMIZER") == "momentum":
        every = int(os.environ.get("ELASTIC_WORKER_SECOND_MOMENT_EVERY", "0"))
        optimizer: torch.optim.Optimizer = MomentumTrackingAdamW(
            model.parameters(), lr=1e-3, betas=(BETA1, 0.999), weight_decay=0.0, second_moment_every=every
        )
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    kill_in_tracker = os.environ.get("ELASTIC_WORKER_KILL_IN") == "tracker" and uid in kills and not joining
    if kill_in_tracker:
        before_trackers_exchange(model, kills[uid], lambda: os.kill(os.getpid(), signal.SIGKILL))
    consensus_every = int(os.environ.get("ELASTIC_WORKER_CONSENSUS_EVERY", CONSENSUS_EVERY))
    slow = os.environ.get("ELASTIC_WORKER_SLOW_TRACKER", "")
    if slow and int(slow.split("@")[0]) == uid and not joining:
        before_trackers_exchange(model, int(slow.split("@")[1]), lambda: time.sleep(SLOW_SECONDS))
    elastic = ElasticRun(model, optimizer, membership, schedule="one_peer_hypercube", algorithm=ExactGossip,
                         timeout=TIMEOUT)  # fmt: skip
    if joining:
        elastic.join()
    with open(os.path.join(out, f"rank{uid}{'.joined' if joining else ''}.jsonl"), "w") as log:
        while model.step_count < steps:
            step = model.step_count
            if not joining and step == int(os.environ.get("ELASTIC_WORKER_HOLD_AT", -1)):  # until a join is asked
                own_client(os.environ[STORE_VARIABLE]).wait(["join/0"], datetime.timedelta(seconds=90))
            elastic.before_step()
            before = model.buckets[0].buffer.tolist()
            row = {"step": step, "before": before}
            if kills.get(uid) == step and not kill_in_tracker:
                log.write(json.dumps(row) + "\n")
                log.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            model(torch.zeros(1, 4, dtype=torch.float64)).sum().backward()
            net.weight.grad.copy_(-delta(uid, step).view(1, 4))
            elastic.update()
            optimizer.zero_grad()
            row["after"] = model.buckets[0].buffer.tolist()
            row["group"] = list(elastic.last_group)
            row["time"] = time.time()
            if tracking:
                row["tracker"] = model.tracker.trackers[0].buffer.tolist()
                row["input"] = model.tracker.previous[0].tolist()
                if isinstance(optimizer, MomentumTrackingAdamW):  # how often its moments advanced, and its samples
                    state = optimizer.state[net.weight]
                    row["moment_steps"], row["samples"] = state["step"], state["samples"]
                    row["sampled_over"], row["shared"] = optimizer.param_groups[0]["workers"], state["shared"].tolist()
            if step % consensus_every == 0:  # between two steps, over the group it trains in (None: none to be had)
                row["consensus"] = elastic.consensus_distance()
            log.write(json.dumps(row) + "\n")
            log.flush()
        elastic.finish()
        log.write(json.dumps({"events": elastic.events, "final": model.buckets[0].buffer.tolist()}) + "\n")
    model.close()
    membership.close()


if __name__ == "__main__":
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w") as pid:
        pid.write(str(os.getpid()))
    try:
        main()
    except Exception as error:  # the test reads what ended the worker
        with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.error"), "w") as file:
            file.write(f"{type(error).__name__}: {error}")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # as gossip-train --elastic: no teardown of the groups abandoned with a dead peer
