"""Backend choice and gossip.init in a single process."""

import pytest
import torch

import gossip
from gossip import bootstrap
from gossip.launch_env import LaunchInfo

SINGLE = LaunchInfo(0, 1, 0, 1, "none")
UNDER_MPIEXEC = LaunchInfo(0, 4, 0, 4, "mpich")
UNDER_TORCHRUN = LaunchInfo(0, 4, 0, 4, "torchrun", "127.0.0.1", 29500)


def test_auto_picks_gloo_without_gpu_or_mpi_launcher():
    assert bootstrap.choose_backend("auto", UNDER_TORCHRUN) == "gloo"
    assert bootstrap.choose_backend("auto", SINGLE) == "gloo"


def test_auto_picks_mpi_under_an_mpi_launcher_with_mpi4py():
    assert bootstrap.choose_backend("auto", UNDER_MPIEXEC) == "mpi"


def test_auto_falls_back_to_gloo_under_mpiexec_without_mpi4py(monkeypatch):
    monkeypatch.setattr(bootstrap, "_mpi4py_importable", lambda: False)
    assert bootstrap.choose_backend("auto", UNDER_MPIEXEC) == "gloo"


def test_mpi_without_mpi4py_names_the_install(monkeypatch):
    monkeypatch.setattr(bootstrap, "_mpi4py_importable", lambda: False)
    with pytest.raises(gossip.BackendUnavailableError, match=r"pip install 'gossip-train\[mpich\]'"):
        bootstrap.choose_backend("mpi", UNDER_MPIEXEC)


def test_mpi_under_torchrun_names_mpiexec():
    with pytest.raises(gossip.BackendUnavailableError, match="launch with mpiexec -n 4"):
        bootstrap.choose_backend("mpi", UNDER_TORCHRUN)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no GPU exists")
def test_nccl_without_gpu_suggests_gloo():
    with pytest.raises(gossip.BackendUnavailableError, match="use backend='gloo' on CPU"):
        bootstrap.choose_backend("nccl", UNDER_TORCHRUN)


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        bootstrap.choose_backend("tcp", SINGLE)


def test_init_rejects_a_non_positive_timeout():
    with pytest.raises(ValueError, match="timeout must be positive"):
        gossip.init(timeout=0)


def test_single_process_init_gives_a_working_world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    comm = gossip.init("gloo", timeout=10.0)
    try:
        assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
        x = torch.arange(4.0)
        comm.all_reduce(x, "avg")
        assert torch.equal(x, torch.arange(4.0))
        comm.exchange([], []).wait()
        assert comm.all_gather_object("only") == ["only"]
    finally:
        comm.close()
