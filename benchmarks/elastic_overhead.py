"""What the elastic path adds to a step when nothing fails, measured paired inside one run.

Whole runs with elastic on and off differ by more than the effect from one run to the next on a shared machine
(benchmarks/README.md, "Elastic gossip: a worker killed mid-run"), so this benchmark measures the two things the
elastic path adds, side by side in the same processes:

* **the exchange**: each of ``--workers`` Gloo workers (under :func:`gossip.app.elastic_launch.launch_elastic`)
  exchanges a ``--floats`` float32 buffer with its one_peer_hypercube partner, ``--rounds`` times through the
  epoch's :class:`~gossip.backends.elastic_comm.ElasticCommunicator` and through the Gloo communicator inside it,
  alternating (the order swapped every round); the paired difference per round is the elastic path's cost (a
  lock, a flag test, and the wait sliced into looks at the membership);
* **the heartbeat**: the membership thread's work, timed as the CPU seconds of its ``_tick`` (a heartbeat, a look
  at the epoch and at the others' heartbeats) times the ticks per second.

``python benchmarks/elastic_overhead.py [--workers 8] [--floats 1048576] [--rounds 200] [--step-ms 120]`` prints,
over all workers, the median exchange time each way, the median paired difference, and both costs as a share of a
step of ``--step-ms`` milliseconds (e.g. the main job's step on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from gossip.app.elastic_launch import launch_elastic  # noqa: E402
from gossip.backends.elastic_comm import open_epoch  # noqa: E402
from gossip.backends.membership import STORE_VARIABLE, connect  # noqa: E402
from topologies import registry  # noqa: E402

TIMEOUT = 60.0


def worker(out: str, floats: int, rounds: int) -> None:
    """One worker: the paired exchanges and the heartbeat's cost, written to OUT/rank<uid>.json."""
    uid, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    membership = connect(os.environ[STORE_VARIABLE], uid, timeout=TIMEOUT)
    sequence = [0]
    elastic = open_epoch(membership, 0, membership.current.members, TIMEOUT, lambda: sequence[0])
    membership.open(0)  # the heartbeat watch runs from here, as in a training run
    schedule = registry.by_name("one_peer_hypercube", size)
    send, receive = torch.randn(floats), torch.empty(floats)
    times: dict[str, list[float]] = {"elastic": [], "plain": []}
    for round_ in range(rounds):
        order = ("elastic", "plain") if round_ % 2 == 0 else ("plain", "elastic")
        for name in order:
            comm = elastic if name == "elastic" else elastic.inner
            (peer,) = {p for p, _ in schedule.peers(uid, round_).in_peers}
            sequence[0] += 1
            started = time.perf_counter()
            comm.exchange([(peer, send)], [(peer, receive)], seq=sequence[0]).wait()
            times[name].append(time.perf_counter() - started)
    ticks = []
    for _ in range(50):
        started = time.thread_time()
        membership._tick()
        ticks.append(time.thread_time() - started)
    elastic.barrier()
    Path(out, f"rank{uid}.json").write_text(json.dumps({**times, "tick_cpu": ticks, "interval": membership.interval}))
    membership.close()
    sys.stdout.flush()
    os._exit(0)  # as gossip-train --elastic: no teardown of the epoch's group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--floats", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=120.0)
    parser.add_argument("--worker", nargs=3, metavar=("OUT", "FLOATS", "ROUNDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, __file__, "--worker", out, str(args.floats), str(args.rounds)]
        code = launch_elastic(args.workers, command, {}, say=lambda message: None)
        runs = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]
    if code != 0 or len(runs) != args.workers:
        print(f"the run failed (status {code}, {len(runs)} of {args.workers} workers reported)")
        sys.exit(1)
    skip = 10  # warm-up rounds
    elastic = [t for run in runs for t in run["elastic"][skip:]]
    plain = [t for run in runs for t in run["plain"][skip:]]
    paired = [e - p for run in runs for e, p in zip(run["elastic"][skip:], run["plain"][skip:], strict=True)]
    tick = statistics.median(t for run in runs for t in run["tick_cpu"])
    heartbeat_share = tick / runs[0]["interval"]  # CPU seconds per second, per worker
    step = args.step_ms / 1e3
    difference = statistics.median(paired)
    print(json.dumps({"workers": args.workers, "floats": args.floats, "rounds": args.rounds,
                      "exchange_ms": {"elastic": statistics.median(elastic) * 1e3,
                                      "plain": statistics.median(plain) * 1e3},
                      "paired_difference_ms": {"median": difference * 1e3,
                                               "quartiles": [q * 1e3 for q in statistics.quantiles(paired, n=4)]},
                      "tick_cpu_ms": tick * 1e3, "heartbeat_cpu_share": heartbeat_share}))  # fmt: skip
    print(f"exchange: elastic {statistics.median(elastic) * 1e3:.3f} ms, plain {statistics.median(plain) * 1e3:.3f} ms"
          f" (median of {len(paired)} paired differences {difference * 1e3:+.3f} ms); heartbeat: {tick * 1e6:.0f} us "
          f"CPU per tick, {heartbeat_share * 100:.2f} % of a core; for a {args.step_ms:.0f} ms step: "
          f"{(difference + heartbeat_share * step) / step * 100:+.2f} %")  # fmt: skip


if __name__ == "__main__":
    main()
