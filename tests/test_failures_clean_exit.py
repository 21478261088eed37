"""A healthy 4-process training job ends with status 0 and nothing alarming on its output, on Gloo and MPI.

About a third of 4-process Gloo runs used to crash at interpreter exit ("terminate called without an active
exception") unless the process group was torn down (environment.md); the Gloo job therefore runs three times
(MPI once: its exit goes through MPI_Finalize, which has not shown the problem). It is
tests/failure_dead_peer_worker.py with no rank killed (model.close(); comm.close(); normal exit).
"""

from __future__ import annotations

import pytest
from failure_launch import N, run

RUNS = {"gloo": 3, "mpi": 1}
ALARMS = ("terminate called", "Traceback", "Error", "Fatal", "Killed", "BAD TERMINATION")


@pytest.mark.parametrize(("backend", "attempt"), [(b, a) for b, runs in RUNS.items() for a in range(runs)])
def test_healthy_job_exits_zero_without_crash_messages(tmp_path, backend, attempt):
    job = run(backend, tmp_path, kill_rank=-1, steps=10)
    assert job.statuses == [0] * N, "\n".join(job.outputs)
    for rank, output in enumerate(job.outputs):
        assert not [alarm for alarm in ALARMS if alarm in output], f"rank {rank}:\n{output}"
