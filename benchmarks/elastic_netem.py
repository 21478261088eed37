"""Elastic gossip on the emulated network: a kill, a join, and the cost when nothing fails, N hosts at a rate.

``sudo python benchmarks/elastic_netem.py [--hosts 8] [--rate 100mbit] [--steps 150] [--floats 1048576]
[--repeats 3] [--kill-step 30] [--rejoin-after 2] [--store-host 0|extra] [--silent] [--kill-only|--no-kill]
[--keep DIR]``
(root, from the repository root; see experiments/netem/README.md) creates one
:class:`experiments.netem.EmulatedNetwork` of ``hosts`` namespaces, each limited to ``rate`` up and down, and runs
in it, ``repeats`` times, interleaved: elastic off and elastic on with nothing failing (their order alternates
between repeats), then elastic on with worker 3 SIGKILLed at the top of ``--kill-step`` and started again
``--rejoin-after`` seconds after the exit was seen, so that it joins (``--kill-only``: only this run,
``--no-kill``: only the others; ``--keep``: every run's logs are copied to ``DIR/<repeat>-<off|on|kill>``). The
workers are benchmarks/elastic_worker.py (exact gossip of a FLOATS-element float32 matrix over one_peer_hypercube,
SGD with momentum 0.9), one per namespace, Gloo on the namespace's ``eth0``.

The membership store cannot be reached from the namespaces when the launcher hosts it outside them, so this file
is its own launcher: ``--coordinate`` runs inside host 0's namespace (``--store-host extra``: a namespace of its
own, one more host at the same rate), hosts the store with :func:`gossip.backends.membership.host_store`, starts
each worker with ``ip netns exec`` in its namespace, reports an unfinished exit with
:func:`~gossip.backends.membership.mark_dead` (as ``gossip-train --elastic`` does; ``--silent``: it does not, and
the survivors find the death by the heartbeat silence; give it a ``--rejoin-after`` above the membership's
detection time, else the restarted worker is still a member and cannot join) and restarts the killed worker.

Printed per run (and as JSON): the step time (mean after the first 10 steps, median over workers); for the kill:
the time from the kill (the worker's own clock just before its SIGKILL) and from the launcher seeing the exit
(it polls every 50 ms) to the survivors' first completed step of the new group; for the join: the time from the
restarted process's start, and from its join request (after its imports and its store connection), to the end of
its first mixing step; the hand-over's payload bytes (parameters and optimizer state, as ``hand_over`` counts them)
and the bytes the joiner's ``eth0`` received and sent from its join request until it was taken in (store traffic,
rendezvous and hand-over); and the survivors' longest step after the failure's re-formation (the one the join
interrupts).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.elastic import read_logs, summarize  # noqa: E402
from gossip.backends.membership import STORE_VARIABLE, host_store, mark_dead  # noqa: E402

WORKER = Path(__file__).resolve().parent / "elastic_worker.py"
KILLED = 3
POLL = 0.05


def coordinate(config: dict) -> int:
    """The launcher inside a namespace: host the store, start the workers, report exits, restart the killed one.

    Args:
        config: ``namespaces`` (one per worker), ``store_address`` (this namespace's address), ``argv`` (a worker's
            command), ``rejoin_after`` (seconds after the killed worker's exit to start it again, or None),
            ``report`` (whether exits are reported to the store), ``out``, ``timeout``.

    Returns:
        0 when every worker ended 0 but the killed one (SIGKILL), else 1 (124 at the timeout).
    """
    namespaces = config["namespaces"]
    store = host_store(len(namespaces))
    env = {**os.environ, STORE_VARIABLE: f"{config['store_address']}:{store.port}", "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": str(len(namespaces)), "GLOO_SOCKET_IFNAME": "eth0"}  # fmt: skip
    times: dict[str, dict[int, float]] = {"spawned": {}, "exited": {}, "respawned": {}}

    def spawn(rank: int) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", namespaces[rank], *config["argv"]],
                                env={**env, "RANK": str(rank)})  # fmt: skip

    running = {}
    for rank in range(len(namespaces)):
        times["spawned"][rank], running[rank] = time.time(), spawn(rank)
    restart_at: dict[int, float] = {}
    codes: list[tuple[int, int]] = []
    deadline = time.monotonic() + config["timeout"]
    while running or restart_at:
        for rank, process in list(running.items()):
            code = process.poll()
            if code is None:
                continue
            del running[rank]
            codes.append((rank, code))
            if code != 0:
                times["exited"].setdefault(rank, time.time())
                if config["report"]:
                    mark_dead(store, rank, f"exited with {code}")
                if config["rejoin_after"] is not None and rank == KILLED and rank not in times["respawned"]:
                    restart_at[rank] = time.monotonic() + config["rejoin_after"]
        for rank, at in list(restart_at.items()):
            if time.monotonic() >= at:
                del restart_at[rank]
                times["respawned"][rank], running[rank] = time.time(), spawn(rank)
        if time.monotonic() > deadline:
            for process in running.values():
                process.kill()
                process.wait()
            return 124
        time.sleep(POLL)
    Path(config["out"], "coordinator.json").write_text(json.dumps({**times, "codes": codes}))
    unexpected = [c for r, c in codes if c != 0 and not (r == KILLED and c == -signal.SIGKILL)]
    return 1 if unexpected else 0


def join_summary(out: Path, logs: dict[int, list[dict]], coordinator: dict, resume: int) -> dict:
    """The joiner's times and bytes (see the module docstring), from its log and the launcher's times."""
    path = out / f"rank{KILLED}.joined.jsonl"
    if not path.exists():
        return {"join_failed": "the restarted worker wrote no log"}
    first, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    mixing = [row for row in rows if "t" in row and len(row["group"]) > 1]
    events = [e for row in rows if "events" in row for e in row["events"] if e.get("joined")]
    if not mixing or not events:
        return {"join_failed": "the restarted worker never mixed"}
    survivors = [[row for row in rows if "t" in row] for uid, rows in logs.items() if uid != KILLED]
    gaps = [b["t"] - a["t"] for rows in survivors for a, b in itertools.pairwise(rows) if a["step"] > resume]
    result = {
        "start_to_first_mix": mixing[0]["t"] - coordinator["respawned"][str(KILLED)],
        "asked_to_first_mix": mixing[0]["t"] - first["join_asked"],
        "asked_to_taken_in": first["joined"] - first["join_asked"],
        "handover_bytes": events[0]["handover_bytes"],
        "join_step": events[0]["resume_step"],
        "survivors_longest_step_after_failure": max(gaps),
    }
    if first["wire_at_ask"] is not None:
        result["join_wire_rx"] = first["wire_at_joined"]["rx"] - first["wire_at_ask"]["rx"]
        result["join_wire_tx"] = first["wire_at_joined"]["tx"] - first["wire_at_ask"]["tx"]
    return result


def run(net: object, store_host: int, args: argparse.Namespace, elastic: bool, kill: bool, name: str) -> dict:
    """One run of the workers in ``net`` under a coordinator in namespace ``store_host``; its summary."""
    from experiments.netem.network import python_path_env

    with tempfile.TemporaryDirectory() as out:
        kills = f"{KILLED}@{args.kill_step}" if kill else ""
        argv = [sys.executable, str(WORKER), out, str(args.steps), kills, str(args.floats), "1" if elastic else "0",
                "0.9"]  # fmt: skip
        config = {"namespaces": [net.namespace(h) for h in range(args.hosts)], "store_address": net.address(store_host),
                  "argv": argv, "rejoin_after": args.rejoin_after if kill else None, "report": not args.silent,
                  "out": out, "timeout": args.timeout}  # fmt: skip
        with open(Path(out, "coordinator.log"), "w") as log:
            process = net.popen(store_host, [sys.executable, __file__, "--coordinate", json.dumps(config)],
                                env=python_path_env(), stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
            code = process.wait()
        logs = read_logs(out)
        result = summarize(code, logs, kill)
        if code != 0:
            result["log_tail"] = Path(out, "coordinator.log").read_text()[-3000:]
        elif kill:
            coordinator = json.loads(Path(out, "coordinator.json").read_text())
            result.update(join_summary(Path(out), logs, coordinator, result["resume_step"]))
        if args.keep:
            shutil.copytree(out, Path(args.keep, name))
    return result


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``min / median / max`` of ``values`` times ``scale``."""
    values = [v * scale for v in values]
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--floats", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=30)
    parser.add_argument("--rejoin-after", type=float, default=2.0)
    parser.add_argument("--store-host", choices=("0", "extra"), default="0")
    parser.add_argument("--silent", action="store_true", help="do not report exits: detection by silence")
    parser.add_argument("--kill-only", action="store_true", help="only the run with the kill and the join")
    parser.add_argument("--no-kill", action="store_true", help="only the runs with nothing failing")
    parser.add_argument("--keep", help="copy each run's logs to KEEP/<repeat>-<run>")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--coordinate", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.coordinate:
        sys.exit(coordinate(json.loads(args.coordinate)))
    from experiments.netem import EmulatedNetwork

    extra = args.store_host == "extra"
    results: list[dict] = []
    with EmulatedNetwork(hosts=args.hosts + extra, rate=args.rate, delay_ms=args.delay_ms) as net:
        store_host = args.hosts if extra else 0
        for repeat in range(args.repeats):
            row = {"repeat": repeat, "load": os.getloadavg()}
            for name in () if args.kill_only else ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                row[name] = run(net, store_host, args, name == "on", False, f"{repeat}-{name}")
            if not args.no_kill:
                row["kill"] = run(net, store_host, args, True, True, f"{repeat}-kill")
            row["load_after"] = os.getloadavg()
            results.append(row)
            print(json.dumps(row), flush=True)
    good = [
        r for r in results if not any(v.get("failed") or "join_failed" in v for v in r.values() if isinstance(v, dict))
    ]
    print(f"{len(good)} of {len(results)} repeats without failure; min / median / max:")
    if not good:
        return
    if not args.kill_only:
        print(f"step time off {spread([r['off']['step_seconds'] for r in good], 1e3, 1)} ms, on "
              f"{spread([r['on']['step_seconds'] for r in good], 1e3, 1)} ms, on/off "
              f"{spread([r['on']['step_seconds'] / r['off']['step_seconds'] for r in good], 1, 3)}")  # fmt: skip
    if args.no_kill:
        return
    kills = [r["kill"] for r in good]
    for key in ("kill_to_next_step_from_kill", "kill_to_next_step", "reformed_since_exit", "start_to_first_mix",
                "asked_to_first_mix", "asked_to_taken_in", "survivors_longest_step_after_failure"):  # fmt: skip
        if all(key in k for k in kills):
            print(f"{key}: {spread([k[key] for k in kills])} s")
    for key in ("handover_bytes", "join_wire_rx", "join_wire_tx"):
        if all(key in k for k in kills):
            print(f"{key}: {spread([k[key] for k in kills], 1e-6, 2)} MB")


if __name__ == "__main__":
    main()
