"""A rendezvous that times out, checked in one process: what rank 0 alone says about the cause (nobody joins), and
that a rank finding no store leaves no store connect running into the interpreter's exit (nobody serves)."""

from __future__ import annotations

import threading

import pytest
from helpers.launch import _free_port

from gossip.backends.launch_env import LaunchInfo
from gossip.backends.rendezvous import rendezvous_store
from gossip.errors import LaunchError


def rank_zero_alone(mpi_launcher: str | None) -> str:
    info = LaunchInfo(0, 4, 0, 4, "torchrun", "127.0.0.1", _free_port(), mpi_launcher)
    with pytest.raises(LaunchError) as caught:
        rendezvous_store(f"tcp://127.0.0.1:{info.master_port}", info, timeout=0.3)
    return str(caught.value)


def test_under_an_mpi_launcher_a_missing_rank_error_names_stale_torchrun_variables():
    message = rank_zero_alone("mpich")
    assert message.startswith("rank 0: rank(s) [1, 2, 3] of 4 did not join the rendezvous at 127.0.0.1:")
    assert (
        "This process was started by mpich, and torchrun's RANK=0 WORLD_SIZE=4 are set too: if they were exported in "
        "the shell (the same on every rank, matching MPI only on this one), the other ranks stopped at once naming "
        "them: unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT before launching with mpiexec"
    ) in message


def test_without_an_mpi_launcher_the_error_does_not_mention_one():
    message = rank_zero_alone(None)
    assert "did not join the rendezvous" in message and "mpiexec" not in message


def test_a_rank_that_finds_no_store_leaves_no_connect_under_way():
    """A store connect still retrying when the rank gave up returned into the interpreter's exit and aborted the rank
    ("terminate called without an active exception", status -6) instead of its exit status 1 with this error."""
    info = LaunchInfo(1, 2, 1, 2, "torchrun", "127.0.0.1", _free_port(), None)
    with pytest.raises(LaunchError) as caught:
        rendezvous_store(f"tcp://127.0.0.1:{info.master_port}", info, timeout=1.0)
    connecting = [thread.name for thread in threading.enumerate() if thread.name.startswith("gossip-rendezvous")]
    assert connecting == [], "a store connect outlived the rank's error"
    assert str(caught.value).startswith(f"rank 1: no rendezvous with rank 0 at 127.0.0.1:{info.master_port} within 1 s")
