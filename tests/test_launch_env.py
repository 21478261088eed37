"""Reading rank, size, local rank and local size from each launcher's environment."""

import pytest

from gossip import LaunchError, detect_launch


def test_no_launcher_is_a_single_process():
    info = detect_launch({})
    assert (info.rank, info.size, info.local_rank, info.local_size, info.launcher) == (0, 1, 0, 1, "none")


def test_torchrun():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }
    info = detect_launch(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (5, 8, 1, 4)
    assert (info.launcher, info.master_addr, info.master_port) == ("torchrun", "h", 29500)


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    info = detect_launch(env)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.launched_by_mpi) == (3, 4, 1, 2, True)


def test_mpich_hydra():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
    info = detect_launch(env)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.launcher) == (2, 4, 2, 4, "mpich")


def test_slurm_job_step_with_uneven_tasks_per_node():
    env = {"SLURM_PROCID": "9", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "11", "SLURM_LOCALID": "1",
           "SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}  # fmt: skip
    info = detect_launch(env)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.launcher) == (9, 11, 1, 3, "slurm")


def test_sbatch_script_outside_srun_is_a_single_process():
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).size == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"),
        ({"WORLD_SIZE": "4"}, "RANK is not set but WORLD_SIZE is"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"rank 4 is outside \[0, 4\)"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, r"rank -1 is outside"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0 must be at least 1"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2 outside"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "local size 4 exceeds world size 2"),
        ({"PMI_RANK": "1", "PMI_SIZE": "1"}, "rank 1 is outside"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "4(y2)"}, "cannot parse"),
    ],
)
def test_inconsistent_environment_is_refused_naming_the_variable(env, message):
    with pytest.raises(LaunchError, match=message):
        detect_launch(env)


@pytest.mark.parametrize(
    "mpi", [{"PMI_RANK": "2", "PMI_SIZE": "4"}, {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}]
)
def test_stale_torchrun_environment_under_mpiexec_names_the_variables_to_unset(mpi):
    stale = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}
    with pytest.raises(LaunchError, match=r"rank 2 of 4, .*RANK=0 WORLD_SIZE=1 .*unset RANK WORLD_SIZE MASTER_PORT"):
        detect_launch({**mpi, **stale})


def test_torchrun_variables_agreeing_with_mpi_are_accepted():
    info = detect_launch({"PMI_RANK": "2", "PMI_SIZE": "4", "RANK": "2", "WORLD_SIZE": "4"})
    assert (info.rank, info.size) == (2, 4)


def test_torchrun_variables_agreeing_with_mpi_record_the_mpi_launcher():
    """Rank 0 of a stale ``RANK=0 WORLD_SIZE=4`` export agrees with MPI by chance; what it records lets its
    rendezvous error say that the variables may be stale (tests/test_rendezvous_hints.py)."""
    info = detect_launch({"PMI_RANK": "0", "PMI_SIZE": "4", "RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "1"})
    assert (info.launcher, info.mpi_launcher) == ("torchrun", "mpich")
    assert detect_launch({"RANK": "0", "WORLD_SIZE": "4"}).mpi_launcher is None
