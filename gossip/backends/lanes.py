r"""Lanes of sharded replicas: the communicators of a world of R replicas, each sharded over G ranks.

The world is laid out on a 2-D ``DeviceMesh`` with dimensions ``("replicate", "shard")``: world rank
:math:`r G + j` holds shard j of replica r (``init_device_mesh(device, (R, G), mesh_dim_names=("replicate",
"shard"))``, the layout of DeepSpeed's MiCS and of HSDP). Each replica is sharded by FSDP2 over
``mesh["shard"]`` only; gossip never enters FSDP's groups. Shard j of every replica forms *lane* j: the R ranks
:math:`\{r G + j\}_r`, which hold the same rows of every parameter and gossip them with each other over W(t) of the
replicas.

:func:`init_lanes` builds, on every rank, two communicators of its own, on process groups created here and used
by nothing else (FSDP2 issues its collectives on the mesh's groups from the training thread, the gossip
communicator from its communication thread; one group shared by both could order their operations differently on
two ranks):

* ``lane``: this rank's lane, rank = the replica index r, size R -- what the gossip wrapper exchanges over;
* ``shard``: this rank's replica, rank = the shard index j, size G -- the wrapper's checks that all lanes run the
  same schedule and settings, and the sums over lanes (consensus distance, averaged metrics).

With ``backend="mpi"`` both are mpi4py communicators split from ``COMM_WORLD`` (colour j, key r for the lane;
colour r, key j for the shard group), which needs the MPI ranks to equal the torch.distributed ranks.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from gossip.backends.base import Communicator
from gossip.backends.bootstrap import DEFAULT_TIMEOUT, init
from gossip.backends.launch_env import LaunchInfo
from gossip.errors import InvalidArgumentError, LaunchError, ShardedLayoutError

#: the names the mesh's two dimensions must carry, in this order
MESH_DIMS = ("replicate", "shard")


class Lanes(NamedTuple):
    """This rank's two communicators of a sharded world.

    Attributes:
        lane: the R ranks holding this rank's shard of every replica; rank = replica index.
        shard: the G ranks of this rank's replica; rank = shard index.
        replica_ranks: the world ranks of this rank's replica, in shard order (what FSDP2 shards over).
        world_rank: this rank in the world.
    """

    lane: Communicator
    shard: Communicator
    replica_ranks: tuple[int, ...]
    world_rank: int


def mesh_layout(mesh: object) -> tuple[list[list[int]], list[list[int]], int, int]:
    """The lanes' and the replicas' world ranks of a ``("replicate", "shard")`` mesh, and this rank's place.

    Args:
        mesh: a 2-D ``torch.distributed.device_mesh.DeviceMesh``.

    Returns:
        ``(lanes, replicas, r, j)``: ``lanes[j]`` the world ranks of lane j in replica order, ``replicas[r]``
            those of replica r in shard order, and this rank's replica r and shard j.

    Raises:
        ShardedLayoutError: the mesh is not 2-D with dimensions named ``("replicate", "shard")``, or does not hold
            this rank.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if getattr(mesh, "ndim", None) != 2 or names != MESH_DIMS:
        raise ShardedLayoutError(
            f"rank {dist.get_rank()}: sharded replicas need a 2-D DeviceMesh with mesh_dim_names={MESH_DIMS}, got "
            f"{getattr(mesh, 'ndim', '?')}-D {names}; build it with init_device_mesh(device, (replicas, shards), "
            f"mesh_dim_names={MESH_DIMS})"
        )
    grid = mesh.mesh.tolist()  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()  # type: ignore[attr-defined]
    if coordinate is None:
        raise ShardedLayoutError(
            f"rank {dist.get_rank()}: this rank is not in the mesh {grid}; every rank of the world must be in it"
        )
    replicas = [list(row) for row in grid]
    lanes = [[row[j] for row in grid] for j in range(len(grid[0]))]
    return lanes, replicas, int(coordinate[0]), int(coordinate[1])


def init_lanes(mesh: object, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT) -> Lanes:
    """The lane and shard communicators of this rank (a collective over the world: every rank calls it once).

    Needs ``torch.distributed`` initialised (FSDP2 and the mesh need it anyway). Every rank creates every lane's and
    every replica's group, in the same order, with ``timeout`` on each (no wait is unbounded).

    Args:
        mesh: the ``("replicate", "shard")`` DeviceMesh the replicas are sharded on.
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"`` (new torch.distributed groups; ``"auto"`` takes the mesh's
            device: Gloo for a CPU mesh), or ``"mpi"`` (mpi4py communicators split from ``COMM_WORLD``).
        timeout: seconds that bound every wait of both communicators.

    Returns:
        :class:`Lanes`: ``lane`` (rank r of R) and ``shard`` (rank j of G).

    Raises:
        LaunchError: torch.distributed is not initialised.
        ShardedLayoutError: the mesh is not a ``("replicate", "shard")`` mesh holding this rank.
        InvalidArgumentError: ``backend`` is unknown.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise LaunchError(
            "gossip.init_lanes(mesh) needs torch.distributed.init_process_group() first (the mesh and FSDP2 need it)"
        )
    lanes, replicas, r, j = mesh_layout(mesh)
    if backend == "mpi":
        return _mpi_lanes(r, j, replicas, len(lanes), timeout)
    if backend not in ("auto", "gloo", "nccl"):
        raise InvalidArgumentError(f"unknown backend {backend!r} for the lanes; choose auto, gloo, nccl or mpi")
    device_type = getattr(mesh, "device_type", "cpu")
    group_backend = ("gloo" if device_type == "cpu" else "nccl") if backend == "auto" else backend
    wait = timedelta(seconds=timeout)
    lane_group, _ = dist.new_subgroups_by_enumeration(lanes, timeout=wait, backend=group_backend)
    shard_group, _ = dist.new_subgroups_by_enumeration(replicas, timeout=wait, backend=group_backend)
    kind = "auto" if backend == "auto" else backend
    lane = init(kind, timeout, group=lane_group)
    shard = init(kind, timeout, group=shard_group)
    if (lane.rank, lane.size, shard.rank, shard.size) != (r, len(replicas), j, len(lanes)):
        raise ShardedLayoutError(
            f"rank {dist.get_rank()}: the lane communicator is rank {lane.rank} of {lane.size} and the shard one "
            f"{shard.rank} of {shard.size}, but the mesh places this rank at replica {r} of {len(replicas)}, shard "
            f"{j} of {len(lanes)}; report this as a bug"
        )
    return Lanes(lane, shard, tuple(replicas[r]), dist.get_rank())


def _mpi_lanes(r: int, j: int, replicas: list[list[int]], shards: int, timeout: float) -> Lanes:
    """The lanes as mpi4py communicators split from ``COMM_WORLD`` (its ranks must be torch.distributed's)."""
    from mpi4py import MPI

    from gossip.backends.mpi import MPICommunicator

    world = MPI.COMM_WORLD
    if world.Get_rank() != dist.get_rank():
        raise LaunchError(
            f"MPI rank {world.Get_rank()} is torch.distributed rank {dist.get_rank()}: the lanes over MPI need both "
            "numberings equal; launch with mpiexec and init torch.distributed with the MPI ranks"
        )
    lane_split, shard_split = world.Split(color=j, key=r), world.Split(color=r, key=j)
    lane = MPICommunicator(LaunchInfo(r, len(replicas), 0, 1, "mpi lane"), timeout, world=lane_split)
    shard = MPICommunicator(LaunchInfo(j, shards, 0, 1, "mpi shard group"), timeout, world=shard_split)
    lane_split.Free()
    shard_split.Free()
    return Lanes(lane, shard, tuple(replicas[r]), dist.get_rank())
