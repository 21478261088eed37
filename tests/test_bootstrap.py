"""Backend choice and gossip.init in a single process."""

import pytest
import torch

import gossip
from gossip.backends import bootstrap
from gossip.backends.launch_env import LaunchInfo

SINGLE = LaunchInfo(0, 1, 0, 1, "none")
UNDER_MPIEXEC = LaunchInfo(0, 4, 0, 4, "mpich")
UNDER_TORCHRUN = LaunchInfo(0, 4, 0, 4, "torchrun", "127.0.0.1", 29500)


@pytest.fixture
def no_gpu(monkeypatch):
    """This host seen without a GPU, also where it has one."""
    monkeypatch.setattr(bootstrap.torch.cuda, "is_available", lambda: False)


def test_auto_picks_gloo_without_gpu_or_mpi_launcher(no_gpu):
    assert bootstrap.choose_backend("auto", UNDER_TORCHRUN) == "gloo"
    assert bootstrap.choose_backend("auto", SINGLE) == "gloo"


def test_auto_picks_mpi_under_an_mpi_launcher_with_mpi4py(no_gpu):
    assert bootstrap.choose_backend("auto", UNDER_MPIEXEC) == "mpi"


def test_auto_falls_back_to_gloo_under_mpiexec_without_mpi4py(monkeypatch, no_gpu):
    monkeypatch.setattr(bootstrap, "_mpi4py_importable", lambda: False)
    assert bootstrap.choose_backend("auto", UNDER_MPIEXEC) == "gloo"


def test_auto_picks_nccl_where_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(bootstrap.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bootstrap.dist, "is_nccl_available", lambda: True)
    assert bootstrap.choose_backend("auto", UNDER_TORCHRUN) == bootstrap.choose_backend("auto", UNDER_MPIEXEC) == "nccl"


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


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "10"])
def test_init_rejects_a_timeout_that_is_not_a_positive_finite_number(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds, got"):
        gossip.init(timeout=timeout)


def test_slurm_port_differs_between_concurrent_steps_of_one_job():
    ports = {bootstrap.slurm_port({"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": str(step)}) for step in range(8)}
    assert len(ports) == 8
    assert all(bootstrap.SLURM_PORT_BASE <= port < bootstrap.SLURM_PORT_BASE + bootstrap.SLURM_PORT_RANGE
               for port in ports)  # fmt: skip


def test_slurm_port_is_the_same_on_every_task_of_a_step():
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_PROCID": "0"}
    assert bootstrap.slurm_port(env) == bootstrap.slurm_port({**env, "SLURM_PROCID": "5"})


def test_slurm_port_with_a_non_integer_step_id_asks_for_master_port():
    with pytest.raises(gossip.LaunchError, match="set MASTER_PORT"):
        bootstrap.slurm_port({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "batch"})


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


@pytest.fixture
def own_default_group(monkeypatch):
    """A world of one whose default Gloo group the test created itself, as a DDP script would."""
    for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_an_existing_default_group_is_adopted_and_outlives_close(own_default_group):
    comm = gossip.init(timeout=10.0)
    assert (comm.backend, comm.rank, comm.size) == ("gloo", 0, 1)
    comm.close()
    assert torch.distributed.is_initialized()
    torch.distributed.all_reduce(torch.ones(1))  # still usable by its creator


def test_a_backend_the_existing_group_does_not_run_is_named(own_default_group):
    with pytest.raises(
        gossip.BackendUnavailableError,
        match=r"backend 'nccl' was asked for, but the existing process group runs 'gloo'; pass backend='auto'",
    ):
        gossip.init("nccl", timeout=10.0)


def test_group_without_a_process_group_asks_for_init_process_group():
    group = object()  # anything: there is no torch.distributed state to take it from
    with pytest.raises(gossip.LaunchError, match=r"needs torch.distributed.init_process_group\(\) to have been"):
        gossip.init(group=group, timeout=10.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="adopting an NCCL group needs a CUDA device")
def test_an_existing_nccl_group_is_adopted_on_the_device_the_script_chose(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    torch.cuda.set_device(torch.cuda.device_count() - 1)
    torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        comm = gossip.init(timeout=30.0)
        assert (comm.backend, comm.device) == ("nccl", torch.device("cuda", torch.cuda.device_count() - 1))
        x = torch.arange(4.0, device=comm.device)
        comm.all_reduce(x, "avg")
        assert torch.equal(x.cpu(), torch.arange(4.0))
        comm.close()
        assert torch.distributed.is_initialized()
    finally:
        torch.distributed.destroy_process_group()
