"""MPI with GPU tensors: whether the MPI library is CUDA-aware is read from it; a CUDA device needs CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mpi4py")
from mpi4py import MPI  # noqa: F401 -- initialises MPI (a singleton) before the library is queried

from gossip.backends.launch_env import detect_launch
from gossip.backends.mpi import MPICommunicator, cuda_aware
from gossip.errors import GossipError


def test_the_mpi_library_is_asked_whether_it_is_cuda_aware(monkeypatch):
    monkeypatch.delenv("GOSSIP_MPI_CUDA_AWARE", raising=False)
    assert cuda_aware() is False  # the test environment's MPICH wheel is built without CUDA
    monkeypatch.setenv("GOSSIP_MPI_CUDA_AWARE", "1")
    assert cuda_aware() is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_mpi_on_cuda_without_a_gpu_is_refused(monkeypatch):
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(GossipError, match=r"rank 0: MPI with device='cuda' needs a visible CUDA device"):
        MPICommunicator(detect_launch(), 5.0, device="cuda")
