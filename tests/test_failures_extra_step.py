"""One rank calls optimizer.step() twice (a mixing-only step on that rank only), on real processes.

tests/helpers/extra_step_worker.py: 4 ranks, ExactGossip on the one-peer hypercube, timeout 10 s; rank 1 takes an
extra step in step 1, so at close() it is inside exchange 5 while its peer of that exchange, rank 3, announces
close() after 4 steps on the same edge. The messages cross and both ends raise ``ExchangeMismatchError`` naming the
other's number (the simulator's twin: tests/test_parallel_invariants.py). Ranks 0 and 2, in close()'s summary, see
their peers leave: Gloo names the failed connection, MPI the launcher's report (a rank Hydra SIGKILLs when the
first one exits may end before it prints). Nobody waits for the timeout, and no message says a rank waits "for
nothing".
"""

from __future__ import annotations

import pytest
from helpers.extra_step_worker import TIMEOUT
from helpers.failure_launch import REPO, alive, pids, run

pytestmark = pytest.mark.multiprocess

AHEAD = (
    "ExchangeMismatchError: step 5: rank 1: exchange 5: message from peer 3: peer 3 is in close() after 4 optimizer "
    "steps: this rank took more steps than peer 3"
)
BEHIND = (
    "ExchangeMismatchError: step 4: rank 3: close() after 4 optimizer steps: message from peer 1 belongs to exchange "
    "5: peer 1 took more steps than this rank"
)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def job(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"extra_step_{request.param}")
    result = run(request.param, out_dir, kill_rank=1, worker=REPO / "tests" / "helpers" / "extra_step_worker.py")
    return request.param, out_dir, result


def stderr(out_dir, rank: int) -> str:
    """What the rank wrote to its standard error (its own file: Hydra may drop the output of ending processes)."""
    return (out_dir / f"rank{rank}.stderr").read_text()


def test_both_ends_of_the_crossed_exchange_name_both_numbers(job):
    backend, out_dir, result = job
    if backend == "gloo":
        for rank, expected in ((1, AHEAD), (3, BEHIND)):
            assert result.statuses[rank] == 1 and expected in stderr(out_dir, rank), stderr(out_dir, rank)
        return
    # MPI: the first of the two to find the crossing exits, and Hydra signals the other, which then may stop on
    # the launcher's report before it reads the crossed message, or be SIGKILLed; the first always names it.
    assert any(expected in stderr(out_dir, r) for r, expected in ((1, AHEAD), (3, BEHIND))), result.outputs
    for rank, expected in ((1, AHEAD), (3, BEHIND)):
        reported = f"rank {rank}: the MPI launcher reported that a process of this job died (SIGUSR1)"
        output = stderr(out_dir, rank)
        assert result.statuses[rank] == -9 or (expected in output or reported in output), output


def test_the_other_ranks_end_with_a_named_error(job):
    backend, out_dir, result = job
    for rank in (0, 2):
        output = stderr(out_dir, rank)
        if backend == "gloo":
            assert result.statuses[rank] == 1, output
            assert f"PeerFailedError: rank {rank}: all_gather_object: a peer failed or closed its connection" in output
        elif result.statuses[rank] != -9:  # not SIGKILLed by Hydra when the first rank exited
            reported = f"rank {rank}: the MPI launcher reported that a process of this job died (SIGUSR1)"
            assert result.statuses[rank] == 1 and reported in output, output


def test_no_rank_waits_for_the_timeout_or_for_nothing(job):
    _, out_dir, result = job
    first_close = min(float(path.read_text()) for path in out_dir.glob("rank*.closing_at"))
    assert result.ended_at - first_close < TIMEOUT / 2, result.ended_at - first_close
    assert not any("waiting for nothing" in stderr(out_dir, rank) for rank in range(4))
    assert [pid for pid in pids(out_dir) if alive(pid)] == []
