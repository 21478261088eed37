"""The MPI launcher's report of a dead process (SIGUSR1 from Hydra under ``mpiexec -disable-auto-cleanup``).

Hydra SIGKILLs every remaining process as soon as the first survivor exits, often before those have printed their
own error. So each rank says, the moment SIGUSR1 arrives, what the launcher reported and what it was waiting for
(the dead peer, when it was exchanging with it), then stops with ``PeerFailedError``. Here the signal is sent by
the test to a rank blocked in an exchange, as Hydra sends it, so the report is checked without Hydra's races
(tests/test_failures_dead_peer.py runs the real kill).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from helpers.launch import REPO, _env, mpiexec, python

pytestmark = pytest.mark.multiprocess


def test_a_rank_signalled_by_the_launcher_reports_what_it_waited_for_and_stops(tmp_path):
    worker = REPO / "tests" / "helpers" / "launcher_report_worker.py"
    command = [mpiexec(), "-disable-auto-cleanup", "-l", "-n", "2", python(), str(worker), str(tmp_path)]
    job = subprocess.Popen(command, env=_env({}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "waiting").exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "waiting").exists(), job.communicate(timeout=5)[0]
        signalled = time.monotonic()
        os.kill(int((tmp_path / "rank0.pid").read_text()), signal.SIGUSR1)
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)  # the "dead" process
        output = job.communicate(timeout=30)[0]
        took = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            job.kill()
    rank0 = (tmp_path / "rank0.stderr").read_text()  # its own file: Hydra may drop the output of ending processes
    assert (
        "gossip: rank 0: the MPI launcher reported that a process of this job died (SIGUSR1) during exchange 3 with "
        "peer(s) [1], waiting to receive from peer 1 (tensor 1/1)"
    ) in rank0, output
    assert "PeerFailedError: rank 0: exchange 3 with peer(s) [1]: the MPI launcher reported" in rank0, output
    assert took < 30.0  # far below the exchange's 60 s timeout: the report stops the wait
