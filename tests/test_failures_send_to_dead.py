"""A send posted to a SIGKILLed peer under Gloo is reported by name, not as a raw "Connection closed by peer"."""

from __future__ import annotations

import subprocess

import pytest
from helpers.launch import REPO, _env, _free_port, python

pytestmark = pytest.mark.multiprocess


def test_a_send_to_a_killed_peer_names_it(tmp_path):
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        argv = [python(), str(REPO / "tests" / "helpers" / "failure_send_to_dead_worker.py"), str(tmp_path)]
        procs.append(subprocess.Popen(argv, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [proc.communicate(timeout=120)[0].decode() for proc in procs]
    assert procs[1].returncode == -9, outputs[1]
    assert (tmp_path / "error.txt").exists(), f"rank 0 exited with {procs[0].returncode}:\n{outputs[0]}"
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith("PeerFailedError: rank 0: exchange 1 with peer(s) [1]: peer 1 failed or closed"), error
