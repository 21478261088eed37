"""Elastic gossip on local Gloo workers: the cost when nothing fails, and the time from a kill to the next step.

``python benchmarks/elastic.py [--workers 8] [--steps 150] [--floats 1048576] [--repeats 2]`` runs, interleaved,
``repeats`` times each: elastic off, elastic on (no failure), and elastic on with worker 3 SIGKILLed at step
``steps // 3``. It prints the mean step time over the steps after the first 10 (median over workers), and for the
kill: the time from the launcher seeing the exit to the new group (the slowest survivor's ``seconds_since_exit``) and
to the first completed step of the new group (the earliest survivor's end of step ``resume_step``). The launcher
polls its workers every 50 ms, so the exit itself happened up to 50 ms before the time these are counted from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gossip.app.elastic_launch import launch_elastic  # noqa: E402

WORKER = Path(__file__).resolve().parent / "elastic_worker.py"


def read_logs(out: str | Path) -> dict[int, list[dict]]:
    """The rows of every ``rank<uid>.jsonl`` under ``out`` (a joiner's ``.joined.jsonl`` is not among them).

    Args:
        out: the workers' output folder.

    Returns:
        uid -> its rows, in order.
    """
    logs = {}
    for path in Path(out).glob("rank*.jsonl"):
        if not path.stem[4:].isdigit():
            continue
        logs[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines()]
    return logs


def summarize(code: int, logs: dict[int, list[dict]], killed: bool) -> dict:
    """Step time and, for a run with a kill, the times from the exit (and from the kill) to the new group's step.

    Args:
        code: the launcher's exit status.
        logs: the workers' rows (:func:`read_logs`).
        killed: whether a worker was told to kill itself.

    Returns:
        ``step_seconds`` (the median over workers of the mean step time after the first 10 steps),
        ``changes_seen``; with a kill ``resume_step``, and ``reformed_since_exit``, ``kill_to_next_step`` (from the
        launcher seeing the exit) where the launcher reported it, ``kill_to_next_step_from_kill`` (from the worker's
        own time just before its SIGKILL); ``failed`` when the run did not end well.
    """
    step_times = []
    for rows in logs.values():
        times = [row["t"] for row in rows if "t" in row]
        if len(times) > 12:
            step_times.append((times[-1] - times[10]) / (len(times) - 11))
    changes = [e for rows in logs.values() if rows and "events" in rows[-1] for e in rows[-1]["events"]]
    if code != 0 or not step_times:  # a failed run is reported, not timed
        return {"code": code, "step_seconds": float("nan"), "changes_seen": len(changes), "failed": True}
    result = {"code": code, "step_seconds": statistics.median(step_times), "changes_seen": len(changes)}
    if killed:
        events = [e for e in changes if e["left"]]
        result["spurious_changes"] = sum(1 for e in changes if not e["left"] and not e.get("joined"))
        resume = events[0]["resume_step"]
        exit_time = events[0]["exit_wall_time"]
        first_done = min(row["t"] for rows in logs.values() for row in rows if row.get("step") == resume and "t" in row)
        result["resume_step"] = resume
        if exit_time is not None:  # the launcher reported the exit
            result.update(reformed_since_exit=max(e["seconds_since_exit"] for e in events),
                          kill_to_next_step=first_done - exit_time)  # fmt: skip
        kill_times = [row["killed_at"] for rows in logs.values() for row in rows if "killed_at" in row]
        if kill_times:
            result["kill_to_next_step_from_kill"] = first_done - min(kill_times)
    return result


def run(workers: int, steps: int, floats: int, elastic: bool, kill: int | None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        kills = f"3@{kill}" if kill is not None else ""
        code = launch_elastic(workers, [sys.executable, str(WORKER), out, str(steps), kills, str(floats),
                                        "1" if elastic else "0"], {3: kill} if kill is not None else {})  # fmt: skip
        logs = read_logs(out)
    return summarize(code, logs, kill is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--floats", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for repeat in range(args.repeats):
        off = run(args.workers, args.steps, args.floats, False, None)
        on = run(args.workers, args.steps, args.floats, True, None)
        killed = run(args.workers, args.steps, args.floats, True, args.steps // 3)
        print(json.dumps({"repeat": repeat, "off": off, "on": on, "kill": killed}), flush=True)
        if any(r.get("failed") for r in (off, on, killed)):
            print(f"repeat {repeat}: a run failed: {off['code']}, {on['code']}, {killed['code']}", flush=True)
            continue
        print(f"repeat {repeat}: step time off {off['step_seconds'] * 1e3:.1f} ms, on {on['step_seconds'] * 1e3:.1f} "
              f"ms ({(on['step_seconds'] / off['step_seconds'] - 1) * 100:+.1f} %); kill: new group "
              f"{killed['reformed_since_exit']:.2f} s after the exit, first step of it done "
              f"{killed['kill_to_next_step']:.2f} s after the exit", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
