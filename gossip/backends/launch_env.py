"""Read rank, size, local rank and local size from the environment a launcher leaves behind.

Supported launchers, checked in this order:

==========  ===========================================  ==============================================
launcher    rank / size                                  local rank / local size
==========  ===========================================  ==============================================
torchrun    ``RANK`` / ``WORLD_SIZE``                    ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``
Open MPI    ``OMPI_COMM_WORLD_RANK`` / ``..._SIZE``      ``OMPI_COMM_WORLD_LOCAL_RANK`` / ``..._LOCAL_SIZE``
MPICH       ``PMI_RANK`` / ``PMI_SIZE``                  ``MPI_LOCALRANKID`` / ``MPI_LOCALNRANKS``
Slurm srun  ``SLURM_PROCID`` / ``SLURM_NTASKS``          ``SLURM_LOCALID`` / from ``SLURM_TASKS_PER_NODE``
none        0 / 1                                        0 / 1
==========  ===========================================  ==============================================

Inside an ``sbatch`` script but outside ``srun``, Slurm sets ``SLURM_PROCID`` as well; only a job step
(``SLURM_STEP_ID`` set) counts as launched by srun.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from gossip.errors import LaunchError

_MPI_LAUNCHERS = ("openmpi", "mpich")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher described it.

    Attributes:
        rank: this process's rank in ``[0, size)``.
        size: the number of processes.
        local_rank: this process's rank on its node.
        local_size: the number of processes on its node.
        launcher: ``"torchrun"``, ``"openmpi"``, ``"mpich"``, ``"slurm"`` or ``"none"``.
        master_addr: the rendezvous host (``MASTER_ADDR``), or None.
        master_port: the rendezvous port (``MASTER_PORT``), or None.
        mpi_launcher: the MPI launcher (``"openmpi"``, ``"mpich"``) that also started this process when torchrun's
            RANK/WORLD_SIZE agree with its view on this rank, else None.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str  # "torchrun", "openmpi", "mpich", "slurm" or "none"
    master_addr: str | None = None
    master_port: int | None = None
    #: The MPI launcher ("openmpi", "mpich") that also started this process when torchrun's RANK/WORLD_SIZE agree
    #: with its view on this rank: consistent, or stale values that match here by chance (rank 0 of an exported
    #: RANK=0); the other ranks then name the conflict, and a rendezvous error on this one says to check for it.
    mpi_launcher: str | None = None

    @property
    def launched_by_mpi(self) -> bool:
        """True when an MPI launcher (Open MPI or MPICH) started this process."""
        return self.launcher in _MPI_LAUNCHERS


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{launcher} environment: {name}={value!r} is not an integer") from None


def _slurm_local_size(env: Mapping[str, str]) -> int:
    """Tasks on this node from ``SLURM_TASKS_PER_NODE`` (e.g. ``"4(x2),3"``) and ``SLURM_NODEID``."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE", "slurm")
    spec = env.get("SLURM_TASKS_PER_NODE")
    if spec is None:
        return 1
    counts: list[int] = []
    for token in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", token.strip())
        if match is None:
            raise LaunchError(f"slurm environment: cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = _int(env, "SLURM_NODEID", "slurm") if "SLURM_NODEID" in env else 0
    if node >= len(counts):
        raise LaunchError(f"slurm environment: SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={spec!r}")
    return counts[node]


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_no_stale_torchrun_environment(env: Mapping[str, str], mpi: LaunchInfo) -> None:
    """Under an MPI launcher, ``RANK``/``WORLD_SIZE`` that disagree with MPI's are left over from a torchrun
    environment (e.g. exported in the shell); every rank would otherwise believe it is the same rank."""
    torchrun_view = (env.get("RANK"), env.get("WORLD_SIZE"))
    if torchrun_view == (str(mpi.rank), str(mpi.size)):
        return  # set consistently by a wrapper script: harmless
    present = [name for name in TORCHRUN_VARIABLES if name in env]
    raise LaunchError(
        f"{mpi.launcher} started this process as rank {mpi.rank} of {mpi.size}, but the environment also holds "
        f"torchrun's RANK={torchrun_view[0]} WORLD_SIZE={torchrun_view[1]} (stale, e.g. exported in the shell); "
        f"unset {' '.join(present)} before launching with mpiexec"
    )


def _read(env: Mapping[str, str]) -> LaunchInfo:
    mpi_launcher = None
    if ("RANK" in env or "WORLD_SIZE" in env) and ("OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env):
        mpi = _read({k: v for k, v in env.items() if k not in TORCHRUN_VARIABLES})
        _check_no_stale_torchrun_environment(env, mpi)
        mpi_launcher = mpi.launcher
    if "RANK" in env or "WORLD_SIZE" in env:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            missing = "WORLD_SIZE" if "RANK" in env else "RANK"
            raise LaunchError(
                f"torchrun-style environment: {missing} is not set but "
                f"{'RANK' if missing == 'WORLD_SIZE' else 'WORLD_SIZE'} is; set both (torchrun does) or neither"
            )
        rank, size = _int(env, "RANK", "torchrun"), _int(env, "WORLD_SIZE", "torchrun")
        local_rank = _int(env, "LOCAL_RANK", "torchrun") if "LOCAL_RANK" in env else rank
        local_size = _int(env, "LOCAL_WORLD_SIZE", "torchrun") if "LOCAL_WORLD_SIZE" in env else size
        port = _int(env, "MASTER_PORT", "torchrun") if "MASTER_PORT" in env else None
        return LaunchInfo(rank, size, local_rank, local_size, "torchrun", env.get("MASTER_ADDR"), port, mpi_launcher)
    if "OMPI_COMM_WORLD_RANK" in env:
        get = lambda key, default=None: (  # noqa: E731
            _int(env, f"OMPI_COMM_WORLD_{key}", "openmpi") if f"OMPI_COMM_WORLD_{key}" in env else default
        )
        rank, size = get("RANK"), get("SIZE", 1)
        return LaunchInfo(rank, size, get("LOCAL_RANK", rank), get("LOCAL_SIZE", size), "openmpi")
    if "PMI_RANK" in env:
        rank = _int(env, "PMI_RANK", "mpich")
        size = _int(env, "PMI_SIZE", "mpich") if "PMI_SIZE" in env else 1
        local_rank = _int(env, "MPI_LOCALRANKID", "mpich") if "MPI_LOCALRANKID" in env else rank
        local_size = _int(env, "MPI_LOCALNRANKS", "mpich") if "MPI_LOCALNRANKS" in env else size
        return LaunchInfo(rank, size, local_rank, local_size, "mpich")
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        rank = _int(env, "SLURM_PROCID", "slurm")
        size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        size = _int(env, size_var, "slurm") if size_var in env else 1
        local_rank = _int(env, "SLURM_LOCALID", "slurm") if "SLURM_LOCALID" in env else 0
        port = _int(env, "MASTER_PORT", "slurm") if "MASTER_PORT" in env else None
        return LaunchInfo(rank, size, local_rank, _slurm_local_size(env), "slurm", env.get("MASTER_ADDR"), port)
    return LaunchInfo(0, 1, 0, 1, "none")


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Return this process's :class:`LaunchInfo`; raise :class:`LaunchError` if the environment is inconsistent.

    Args:
        env: the environment to read; None reads ``os.environ``.

    Returns:
        The rank, size, local rank and size, and launcher of this process.

    Raises:
        LaunchError: the size is below 1, the rank is outside ``[0, size)``, the local rank or size is out of
            range, or a variable is not an integer; the message names the launcher and the variable.
    """
    info = _read(os.environ if env is None else env)
    if info.size < 1:
        raise LaunchError(f"{info.launcher} environment: world size {info.size} must be at least 1")
    if not 0 <= info.rank < info.size:
        raise LaunchError(f"{info.launcher} environment: rank {info.rank} is outside [0, {info.size})")
    if info.local_size < 1 or not 0 <= info.local_rank < info.local_size:
        raise LaunchError(
            f"{info.launcher} environment: rank {info.rank} has local rank {info.local_rank} "
            f"outside [0, local size {info.local_size})"
        )
    if info.local_size > info.size:
        raise LaunchError(f"{info.launcher} environment: local size {info.local_size} exceeds world size {info.size}")
    return info
