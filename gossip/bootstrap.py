"""``gossip.init``: detect the launcher, pick a backend, rendezvous, return a communicator.

Backends:

* ``"mpi"``  -- mpi4py; needs an MPI launcher (``mpiexec``/``mpirun``, or ``srun --mpi=pmix``).
* ``"gloo"`` -- torch.distributed on CPU. Rendezvous from ``MASTER_ADDR``/``MASTER_PORT`` (torchrun sets them);
  under an MPI launcher the address is broadcast over MPI instead, so none is needed; under a single-node
  ``srun`` a port is derived from the job id.
* ``"nccl"`` -- torch.distributed on the GPU of this process's local rank; rendezvous as for Gloo.
* ``"auto"`` -- nccl when CUDA is available, else mpi when launched by an MPI launcher with mpi4py importable,
  else gloo.

A single process without a launcher gets a world of size 1 (Gloo on an in-memory store).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess

import torch
import torch.distributed as dist

from gossip.backends.base import Communicator
from gossip.errors import BackendUnavailableError, LaunchError
from gossip.launch_env import LaunchInfo, detect_launch

BACKENDS = ("auto", "mpi", "gloo", "nccl")
DEFAULT_TIMEOUT = 120.0


def _mpi4py_importable() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def choose_backend(requested: str, info: LaunchInfo) -> str:
    """Resolve ``requested`` (one of :data:`BACKENDS`) to a concrete backend, or explain why it cannot run."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKENDS}")
    if requested == "auto":
        if torch.cuda.is_available() and dist.is_nccl_available():
            return "nccl"
        if info.launched_by_mpi and _mpi4py_importable():
            return "mpi"
        return "gloo"
    if requested == "mpi" and not _mpi4py_importable():
        raise BackendUnavailableError(
            "backend 'mpi' needs mpi4py and an MPI library: pip install 'gossip-train[mpi]' "
            "(mpi4py plus the mpich wheel), or pip install mpi4py against your cluster's MPI"
        )
    if requested == "mpi" and info.size > 1 and not info.launched_by_mpi:
        raise BackendUnavailableError(
            f"backend 'mpi' needs an MPI launcher, but this process was started by {info.launcher} "
            f"(world size {info.size}); launch with mpiexec -n {info.size}, or choose backend='gloo'"
        )
    if requested == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise BackendUnavailableError(
            "backend 'nccl' needs a CUDA build of torch and a visible GPU; this process sees none "
            f"(torch.cuda.is_available()={torch.cuda.is_available()}); use backend='gloo' on CPU"
        )
    if requested == "gloo" and not dist.is_gloo_available():
        raise BackendUnavailableError("backend 'gloo' is not compiled into this torch build; use 'mpi' or 'nccl'")
    return requested


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _address_over_mpi() -> str:
    """Rank 0 picks its address and a free port; MPI broadcasts them to everyone."""
    from mpi4py import MPI

    address = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        address = f"tcp://{host}:{_free_port()}"
    return MPI.COMM_WORLD.bcast(address, root=0)


def _slurm_address(info: LaunchInfo) -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    first = "127.0.0.1"
    if int(os.environ.get("SLURM_NNODES", "1")) > 1:
        if shutil.which("scontrol") is None:
            raise LaunchError("srun across nodes without MASTER_ADDR: set MASTER_ADDR and MASTER_PORT")
        first = subprocess.run(
            ["scontrol", "show", "hostnames", nodes], check=True, capture_output=True, text=True
        ).stdout.split()[0]
    port = info.master_port or 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000
    return f"tcp://{first}:{port}"


def _init_method(info: LaunchInfo) -> str | None:
    if info.master_addr and info.master_port:
        return f"tcp://{info.master_addr}:{info.master_port}"
    if info.launched_by_mpi and _mpi4py_importable():
        return _address_over_mpi()
    if info.launcher == "slurm":
        return _slurm_address(info)
    if info.launcher == "torchrun":
        raise LaunchError(
            f"rank {info.rank}: RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; "
            "torchrun sets all four -- set MASTER_ADDR and MASTER_PORT"
        )
    if info.launched_by_mpi:
        raise BackendUnavailableError(
            "Gloo under mpiexec needs MASTER_ADDR/MASTER_PORT or mpi4py to broadcast them: "
            "pip install 'gossip-train[mpi]'"
        )
    return None


def init(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT, *, mpi_device: str = "cpu") -> Communicator:
    """Return a communicator for this process, as launched (mpirun, srun, torchrun, or a single process).

    ``timeout`` (seconds) bounds every wait; on expiry the error names this rank, the peer(s) it waited for
    and the operation. ``mpi_device`` ("cpu" or "cuda": this rank's GPU by local rank) is where the tensors an MPI
    communicator moves live; Gloo moves CPU tensors and NCCL GPU tensors.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    info = detect_launch()
    chosen = choose_backend(backend, info)
    if chosen == "mpi":
        from gossip.backends.mpi import MPICommunicator

        return MPICommunicator(info, timeout, mpi_device)
    from gossip.backends.torch_dist import TorchDistCommunicator

    if info.size == 1 and not (info.master_addr and info.master_port):
        return TorchDistCommunicator(chosen, info, None, timeout, store=dist.HashStore())
    return TorchDistCommunicator(chosen, info, _init_method(info), timeout)
