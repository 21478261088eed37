"""A peer SIGKILLed mid-training: every survivor ends fast with a named error and a non-zero status, none hangs.

tests/helpers/failure_dead_peer_worker.py trains with ExactGossip on ring(4) (timeout 5 s); rank 2 kills itself at the
top of step 5. What each survivor sees:

* Gloo: ranks 1 and 3 (rank 2's neighbours) get "connection closed" from Gloo at once: ``PeerFailedError`` naming
  peer 2 at step 5 or 6 (rank 2 may have sent step 5's message before dying). Rank 0 waits only on 1 and 3; it
  gets the same error naming peer 1 or 3 as soon as one of them exits.
* MPI (``mpiexec -disable-auto-cleanup``): MPI does not detect the death, but Hydra sends SIGUSR1 to every
  survivor; the communicator turns it into ``PeerFailedError`` naming the peers still awaited (2 for its
  neighbours, 1 and 3 for rank 0). Hydra (MPICH 5.0.2) nevertheless SIGKILLs survivors that are still running when
  another one exits, so a survivor may end killed (status -9) before its error is printed; every one that exits by
  itself must exit with status 1 and the named error. (Each survivor also says on stderr, the moment SIGUSR1
  arrives, what the launcher reported and what it was waiting for: tests/test_failures_launcher_report.py; Hydra
  sometimes SIGKILLs the whole job before it has signalled every survivor, so it is not asserted here.)

The job must end within a few seconds of the kill (well under the 5 s timeout, as nobody waits for it) and leave
no process behind.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from helpers.failure_dead_peer_worker import KILL_STEP, TIMEOUT
from helpers.failure_launch import N, alive, pids, run

from gossip.backends import torch_dist
from gossip.backends.comm_thread import Progress
from gossip.errors import PeerFailedError

DEAD = 2
NEIGHBOURS = (1, 3)
ERROR = re.compile(r"(PeerFailedError|CommTimeoutError): step (\d+): rank (\d): .*peer.*")


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def job(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"dead_peer_{request.param}")
    result = run(request.param, out_dir, kill_rank=DEAD)
    killed_at = float((out_dir / "killed_at").read_text())
    print(f"{request.param}: all processes ended {result.ended_at - killed_at:.2f} s after the kill")
    return request.param, out_dir, result, killed_at


def survivors(job):
    backend, _, result, _ = job
    for rank in range(N):
        if rank != DEAD and not (backend == "mpi" and result.statuses[rank] == -9):
            yield rank, result.statuses[rank], result.outputs[rank]


def test_the_killed_rank_died_of_sigkill(job):
    assert job[2].statuses[DEAD] == -9


def test_every_survivor_exits_non_zero(job):
    statuses = [s for r, s in enumerate(job[2].statuses) if r != DEAD]
    assert all(status != 0 for status in statuses), statuses


def test_every_survivor_that_exits_by_itself_names_the_step_and_a_peer(job):
    for rank, status, output in survivors(job):
        found = ERROR.search(output)
        assert status == 1 and found is not None, f"rank {rank} (status {status}):\n{output}"
        assert int(found.group(3)) == rank and int(found.group(2)) >= KILL_STEP


def test_the_dead_ranks_neighbours_name_it(job):
    for rank, _, output in survivors(job):
        if rank in NEIGHBOURS:
            assert f"peer {DEAD}" in ERROR.search(output).group(0), output


def test_the_job_ends_within_the_timeout_of_the_kill(job):
    _, _, result, killed_at = job
    assert result.ended_at - killed_at < TIMEOUT + 5.0


def test_no_process_is_left_running(job):
    _, out_dir, _, _ = job
    assert [pid for pid in pids(out_dir) if alive(pid)] == []


def test_no_crash_at_exit(job):
    for _, _, output in survivors(job):
        assert "terminate called" not in output and "Fatal Python error" not in output, output


@pytest.mark.parametrize("order", [(0, 2), (2, 0)])
def test_a_refused_post_names_the_peer_it_was_for_not_all_the_steps_peers(monkeypatch, order):
    """Gloo refuses a post to a closed connection at once; the error names that op's peer, whatever the order."""
    posted = []

    def batch_isend_irecv(batch):
        (op,) = batch  # Gloo does not coalesce: one operation a post
        if op.peer == DEAD:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")
        posted.append(op.peer)
        return [object()]

    monkeypatch.setattr(torch_dist.dist, "batch_isend_irecv", batch_isend_irecv)
    rank_3 = SimpleNamespace(backend="gloo", rank=3, _local=lambda peer: peer)
    ops = [SimpleNamespace(peer=peer) for peer in order for _ in range(2)]
    with pytest.raises(PeerFailedError, match=rf"rank 3: exchange 5: peer {DEAD} failed or closed its connection"):
        torch_dist.TorchDistCommunicator._post(rank_3, ops, "post its messages", Progress("exchange 5"))
    assert posted == [0, 0][: 2 * (order[0] == 0)]
