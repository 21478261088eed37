"""What a rendezvous that times out says about its cause, checked in one process (rank 0 alone, nobody joins)."""

from __future__ import annotations

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
