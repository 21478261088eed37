"""Elastic training over several nodes: one launcher per node, node 0's hosting the membership store.

Two launchers on this host play two nodes of two workers each (``gossip-train --nproc 2 --elastic --nnodes 2
--node-rank K`` with node 0's MASTER_ADDR and MASTER_PORT). Pinned:

* a worker of node 1 SIGKILLed: its launcher reports it to node 0's store, the three survivors (on both nodes)
  agree on one change and finish; both launchers exit 0 and the summary names the departure;
* node 1 lost whole (its launcher and its workers SIGKILLed together, as a node that goes down): nobody reports
  the exits, so node 0's workers declare both dead after the membership's silence bound and finish as a group of
  two; node 0's launcher stops waiting for node 1 once its workers have been silent that long, and exits 0;
* the options are refused by name where they cannot work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.launch import REPO, _free_port

from gossip.app.cli import main

ARGS = ["--nproc", "2", "--elastic", "--nnodes", "2", "--batch-size", "4", "--algorithm", "exact", "--eval-every",
        "100"]  # fmt: skip


def start_node(rank: int, out: Path, port: int, steps: int, extra: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    command = [sys.executable, "-m", "gossip", *ARGS, "--node-rank", str(rank), "--steps", str(steps), "--out",
               str(out), *extra]  # fmt: skip
    with open(log, "w") as file:  # a session of its own: the whole node can be killed at once
        return subprocess.Popen(command, env=env, stdout=file, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {seconds} s"
        time.sleep(0.05)


def _steps_logged(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.multiprocess
def test_a_worker_of_another_node_dies_and_every_survivor_trains_on(tmp_path):
    out, port = tmp_path / "run", _free_port()
    nodes = [start_node(r, out, port, 16, ["--kill", "3@8"], tmp_path / f"node{r}.log") for r in (0, 1)]
    try:
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], logs
    assert "gossip-train: worker 3 killed by SIGKILL" in logs[1]  # reported by its own node's launcher
    (event,) = json.loads((out / "result.json").read_text())["membership"]
    assert event["left"] == {"3": "killed by SIGKILL"} and event["members"] == [0, 1, 2]
    assert event["seconds_since_exit"] is not None  # the exit was reported, not found by silence


@pytest.mark.multiprocess
def test_a_lost_node_is_found_by_silence_and_the_other_trains_on(tmp_path):
    out, port = tmp_path / "run", _free_port()
    nodes = [start_node(r, out, port, 60, [], tmp_path / f"node{r}.log") for r in (0, 1)]
    try:
        _wait_for(lambda: _steps_logged(out / "metrics_rank2.jsonl") >= 5, 180, "5 steps on node 1")
        os.killpg(nodes[1].pid, signal.SIGKILL)  # its launcher and its workers, at once: nobody reports the exits
        lost = time.monotonic()
        code = nodes[0].wait(timeout=240)
        print(f"node 0's launcher ended {time.monotonic() - lost:.1f} s after node 1 was lost")
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    log = (tmp_path / "node0.log").read_text()
    assert code == 0, log
    (event,) = json.loads((out / "result.json").read_text())["membership"]
    assert event["left"] == {"2": "silent for 10.0 s", "3": "silent for 10.0 s"} and event["members"] == [0, 1]
    assert event["seconds_since_exit"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2"], "--nnodes/--node-rank: needs --elastic and --nproc"),
        (["--nproc", "2", "--elastic", "--nnodes", "2", "--node-rank", "2"], "--node-rank: 2 is outside [0, 2)"),
        (["--nproc", "2", "--elastic", "--nnodes", "2"], "several nodes need MASTER_ADDR and MASTER_PORT"),
    ],
)
def test_node_options_are_refused_by_name(args, message, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err
