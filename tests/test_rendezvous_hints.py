"""A rendezvous that times out, checked in one process: what rank 0 alone says about the cause (nobody joins), and
that a rank finding no store leaves no connect running into the interpreter's exit (nobody serves)."""

from __future__ import annotations

import atexit
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


def test_a_connect_still_under_way_at_the_error_is_waited_for_at_exit_and_ends_by_then(monkeypatch):
    """A store connect that returned into an interpreter shutting down aborted the rank ("terminate called without
    an active exception", status -6) instead of its exit status 1 with the error below."""
    waits, register = [], atexit.register

    def record(function, *args, **kwargs):  # a thread's join is recorded, anything else registered as usual
        if isinstance(getattr(function, "__self__", None), threading.Thread):
            waits.append((function.__self__, *args))
            return function
        return register(function, *args, **kwargs)

    monkeypatch.setattr(atexit, "register", record)
    info = LaunchInfo(1, 2, 1, 2, "torchrun", "127.0.0.1", _free_port(), None)
    with pytest.raises(LaunchError) as caught:
        rendezvous_store(f"tcp://127.0.0.1:{info.master_port}", info, timeout=1.0)
    connecting = [thread for thread in threading.enumerate() if thread.name == "gossip-rendezvous-rank1"]
    assert str(caught.value).startswith(f"rank 1: no rendezvous with rank 0 at 127.0.0.1:{info.master_port} within 1 s")
    assert {thread for thread, _ in waits} >= set(connecting), "a connect under way is not waited for at exit"
    for thread, seconds in waits:
        thread.join(seconds)
        assert not thread.is_alive(), f"the connect outlived the exit's wait of {seconds} s"
