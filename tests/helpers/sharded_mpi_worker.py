"""Worker: 2 replicas x 2 FSDP2 shards launched by ``mpiexec -n 4``, the lanes on MPI (``init_lanes(mesh,
backend="mpi")``), for tests/test_sharded_mpi.py.

torch.distributed (Gloo, which FSDP2 needs) is started with the MPI ranks: rank 0's address goes out over mpi4py.
The lanes are then mpi4py communicators split from ``COMM_WORLD``, and the phases of tests/helpers/sharded_worker.py
that compare the sharded run with unsharded replicas (exact gossip; momentum tracking with the mean gradient's
sample gossiped) run on them unchanged.

Usage (by tests/helpers/launch.py): mpiexec -n 4 python tests/helpers/sharded_mpi_worker.py OUT_DIR
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh

from gossip.backends.lanes import init_lanes
from helpers.sharded_worker import G, R, exact_against_unsharded, momentum_against_unsharded


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    address = None
    if world.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    address = world.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=address, rank=world.Get_rank(), world_size=world.Get_size())
    mesh = init_device_mesh("cpu", (R, G), mesh_dim_names=("replicate", "shard"))
    lanes = init_lanes(mesh, backend="mpi", timeout=30.0)
    result: dict[str, Any] = {
        "replica": lanes.lane.rank,
        "shard": lanes.shard.rank,
        "communicators": (type(lanes.lane).__name__, type(lanes.shard).__name__),
        "sizes": (lanes.lane.size, lanes.shard.size),
        "replica_ranks": lanes.replica_ranks,
    }
    exact_against_unsharded(mesh, lanes, result)
    momentum_against_unsharded(mesh, lanes, result)
    lanes.lane.close()
    lanes.shard.close()
    torch.save(result, out_dir / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
