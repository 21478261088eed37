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
import math
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping

import torch
import torch.distributed as dist

from gossip.backends.base import Communicator
from gossip.backends.launch_env import LaunchInfo, detect_launch
from gossip.backends.rendezvous import agent_serves_the_store, rendezvous_store
from gossip.errors import BackendUnavailableError, InvalidArgumentError, LaunchError

BACKENDS = ("auto", "mpi", "gloo", "nccl")
DEFAULT_TIMEOUT = 120.0


def _mpi4py_importable() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def choose_backend(requested: str, info: LaunchInfo) -> str:
    """Resolve ``requested`` (one of :data:`BACKENDS`) to a concrete backend, or explain why it cannot run.

    ``"auto"`` picks ``"nccl"`` with a visible GPU, else ``"mpi"`` under an MPI launcher with mpi4py importable,
    else ``"gloo"``.

    Args:
        requested: one of :data:`BACKENDS`.
        info: where this process sits in the job (its launcher decides whether MPI can run).

    Returns:
        ``"gloo"``, ``"nccl"`` or ``"mpi"``.

    Raises:
        InvalidArgumentError: ``requested`` is not one of :data:`BACKENDS`.
        BackendUnavailableError: the backend cannot run in this process; the message names the fix.
    """
    if requested not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {requested!r}; choose one of {BACKENDS}")
    if requested == "auto":
        if torch.cuda.is_available() and dist.is_nccl_available():
            return "nccl"
        if info.launched_by_mpi and _mpi4py_importable():
            return "mpi"
        return "gloo"
    if requested == "mpi" and not _mpi4py_importable():
        raise BackendUnavailableError(
            "backend 'mpi' needs mpi4py and an MPI library: pip install 'gossip-train[mpich]' "
            "(mpi4py plus the MPICH wheel), or, on a cluster, pip install --no-binary mpi4py 'gossip-train[mpi]' "
            "(mpi4py built against the MPI on PATH)"
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
    return f"tcp://{first}:{info.master_port or slurm_port(os.environ)}"


SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 20000


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of a Slurm job step without ``MASTER_PORT``.

    Derived from the job id *and* the step id, so that concurrent steps of one job (``srun ... &`` twice) do not
    meet at the same port: ``SLURM_PORT_BASE + (job * 1009 + step) % SLURM_PORT_RANGE``.

    Args:
        env: the environment (``SLURM_JOB_ID``, ``SLURM_STEP_ID``; each 0 when absent).

    Returns:
        The port.

    Raises:
        LaunchError: ``SLURM_JOB_ID`` or ``SLURM_STEP_ID`` is not an integer.
    """
    try:
        job, step = int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_STEP_ID", "0"))
    except ValueError:
        raise LaunchError(
            f"slurm environment: SLURM_JOB_ID={env.get('SLURM_JOB_ID')!r} / SLURM_STEP_ID="
            f"{env.get('SLURM_STEP_ID')!r} are not integers; set MASTER_PORT"
        ) from None
    return SLURM_PORT_BASE + (job * 1009 + step) % SLURM_PORT_RANGE


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
            "pip install 'gossip-train[mpich]' (or [mpi] for your cluster's MPI)"
        )
    return None


def init(
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    *,
    group: dist.ProcessGroup | None = None,
    mpi_device: str = "cpu",
) -> Communicator:
    """Return a communicator for this process, as launched (mpirun, srun, torchrun, or a single process).

    Code that already called ``torch.distributed.init_process_group()`` (a DDP script, HF Accelerate, Decent-DP)
    gets a communicator on that default group, or on ``group`` (e.g. from ``dist.new_group``) when given; ranks
    are then the group's. The communicator's ``close()`` leaves such a group alive: whoever created it destroys it.
    ``backend="mpi"`` always uses MPI, whatever torch.distributed holds.

    Args:
        backend: one of :data:`BACKENDS` (``"auto"``: see :func:`choose_backend`).
        timeout: seconds that bound every wait; on expiry the error names this rank, the peer(s) it waited for
            and the operation.
        group: a torch.distributed process group to adopt instead of the default one.
        mpi_device: ``"cpu"`` or ``"cuda"`` (this rank's GPU by local rank): where the tensors an MPI communicator
            moves live; Gloo moves CPU tensors and NCCL GPU tensors.

    Returns:
        The communicator; ``close()`` it (or let the exit handler do so) when done.

    Raises:
        InvalidArgumentError: ``timeout`` is not a positive, finite number, ``backend`` is unknown, or ``group``
            is given with ``backend="mpi"``.
    """
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise InvalidArgumentError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    if group is not None or (backend != "mpi" and dist.is_available() and dist.is_initialized()):
        return _adopt(backend, group, timeout)
    info = detect_launch()
    chosen = choose_backend(backend, info)
    if chosen == "mpi":
        from gossip.backends.mpi import MPICommunicator

        return MPICommunicator(info, timeout, mpi_device)
    from gossip.backends.torch_dist import TorchDistCommunicator

    if info.size == 1 and not (info.master_addr and info.master_port):
        return TorchDistCommunicator(chosen, info, None, timeout, store=dist.HashStore())
    address = _init_method(info)
    if agent_serves_the_store():
        return TorchDistCommunicator(chosen, info, address, timeout)
    return TorchDistCommunicator(chosen, info, None, timeout, store=rendezvous_store(address, info, timeout))


def _adopted_backend(requested: str, group: dist.ProcessGroup) -> str:
    """What ``requested`` resolves to on ``group``, "gloo" or "nccl" (its backend may read "cpu:gloo,cuda:nccl")."""
    described = str(dist.get_backend(group))
    kinds = {part.split(":")[-1] for part in described.split(",")}
    if requested == "mpi":
        raise InvalidArgumentError("group= is a torch.distributed process group; backend 'mpi' does not use one")
    if requested not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {requested!r}; choose one of {BACKENDS}")
    if requested == "auto":
        requested = "nccl" if "nccl" in kinds and torch.cuda.is_available() else "gloo"
    if requested not in kinds:
        raise BackendUnavailableError(
            f"backend {requested!r} was asked for, but the existing process group runs {described!r}; "
            f"pass backend='auto' or one of {sorted(kinds & {'gloo', 'nccl'})}"
        )
    return requested


def _local_placement(group: dist.ProcessGroup, rank: int, size: int) -> tuple[int, int]:
    """(local rank, local size) in ``group``: the launcher's when the group is the whole launched world, else
    counted from the host names of the group's members (a small collective)."""
    try:
        info = detect_launch()
    except LaunchError:
        info = None
    if group is dist.group.WORLD and info is not None and (info.rank, info.size) == (rank, size):
        return info.local_rank, info.local_size
    hosts: list[str | None] = [None] * size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    me = hosts[rank]
    return hosts[:rank].count(me), hosts.count(me)


def _adopt(requested: str, group: dist.ProcessGroup | None, timeout: float) -> Communicator:
    """A communicator on a process group created outside this library (see :func:`init`)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise LaunchError(
            "init(group=...) needs torch.distributed.init_process_group() to have been called first; "
            "or call gossip.init() without group= and it creates the process group itself"
        )
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise LaunchError(
            f"global rank {dist.get_rank()}: gossip.init(group=...) was given a process group this process is not "
            "a member of; every member calls init with its own group"
        )
    chosen, size = _adopted_backend(requested, group), dist.get_world_size(group)
    local_rank, local_size = _local_placement(group, rank, size)
    info = LaunchInfo(rank, size, local_rank, local_size, "process group")
    from gossip.backends.torch_dist import TorchDistCommunicator

    return TorchDistCommunicator(chosen, info, None, timeout, adopt=group)
