"""What the gossip wrappers accept of a sharded model, and the staging copy through which the local shards are mixed.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns each managed parameter into a ``DTensor`` whose local shard
is a view of FSDP's own padded storage (the all-gather input). Gossip must not rebind that storage, so the
sharded wrapper never moves the parameters into buckets as the unsharded one does
(:func:`gossip.algorithms.buckets.bucket_parameters`); instead :class:`Staging` holds flat buckets laid out like
the local shards, *filled from* them before each exchange starts and *written back* into them once the mixing is
done (the pattern of :mod:`gossip.algorithms.powergossip_shadow`). Between the two the staging is the memory the
exchange sends, and FSDP2's all-gathers read the shards, which nobody writes meanwhile.

The checks refuse, with :class:`gossip.errors.ShardedLayoutError` naming the parameter, what would mix wrongly:

* DTensor parameters given to the unsharded :class:`gossip.DecentralizedDataParallel` (it would rebind FSDP's
  storage and gossip a detached copy);
* FSDP1 (``FullyShardedDataParallel``, flat parameters whose shard boundaries cut rows across parameters);
* a parameter sharded over a 2-D mesh (HSDP: FSDP would average the gradients across replicas, i.e. DDP), over
  another group than this rank's replica, with a placement other than ``Shard(d)``, or not sharded at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gossip.algorithms.buckets import Bucket, pack
from gossip.errors import ShardedLayoutError

try:  # torch >= 2.4 has the public DTensor (FSDP2 needs torch >= 2.6 on CPU)
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - an old torch: nothing can be a DTensor
    DTensor, Shard = None, None  # type: ignore[assignment,misc]

_HOW = (
    "shard each replica with torch.distributed.fsdp.fully_shard(..., mesh=mesh['shard']) on a "
    "('replicate', 'shard') DeviceMesh and wrap it in gossip.ShardedDecentralizedDataParallel(model, "
    "gossip.init_lanes(mesh), schedule, algorithm)"
)


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (False on a torch without DTensor).

    Args:
        tensor: any object.

    Returns:
        True for a DTensor.
    """
    return DTensor is not None and isinstance(tensor, DTensor)


def _fsdp1_module(module: nn.Module) -> str | None:
    """The name of the first FSDP1 (``FullyShardedDataParallel``) submodule of ``module``, or None."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    for name, inner in module.named_modules():
        if isinstance(inner, FullyShardedDataParallel):
            return name or type(module).__name__
    return None


def refuse_sharded(module: nn.Module, rank: int) -> None:
    """For the unsharded wrapper: refuse a model whose parameters are FSDP shards (FSDP1 or FSDP2).

    Args:
        module: the model given to :class:`gossip.DecentralizedDataParallel`.
        rank: this rank, for the message.

    Raises:
        ShardedLayoutError: a parameter is a DTensor, or a submodule is FSDP1.
    """
    fsdp1 = _fsdp1_module(module)
    if fsdp1 is not None:
        raise ShardedLayoutError(
            f"rank {rank}: '{fsdp1}' is FSDP1 (FullyShardedDataParallel), whose flat shards cut rows across "
            f"parameters; gossip cannot mix them. Use FSDP2 instead: {_HOW}"
        )
    for name, parameter in module.named_parameters():
        if is_dtensor(parameter):
            raise ShardedLayoutError(
                f"rank {rank}: parameter '{name}' is a DTensor (sharded by FSDP2 or tensor parallelism); "
                f"DecentralizedDataParallel would rebind its storage and gossip a detached copy. {_HOW}"
            )


def check_sharded_module(module: nn.Module, replica_ranks: Sequence[int], rank: int) -> None:
    """Refuse a model that is not sharded by FSDP2 over exactly this rank's replica, one ``Shard(d)`` per parameter.

    Args:
        module: the model given to the sharded wrapper.
        replica_ranks: the world ranks of this rank's replica, in shard order (``Lanes.replica_ranks``).
        rank: this rank (world), for the message.

    Raises:
        ShardedLayoutError: naming the parameter and what to do.
    """
    if DTensor is None:  # pragma: no cover - an old torch
        raise ShardedLayoutError(f"rank {rank}: sharded replicas need torch.distributed.tensor (torch >= 2.6)")
    fsdp1 = _fsdp1_module(module)
    if fsdp1 is not None:
        raise ShardedLayoutError(
            f"rank {rank}: '{fsdp1}' is FSDP1 (FullyShardedDataParallel), whose flat shards cut rows across "
            f"parameters; gossip mixes FSDP2's per-parameter shards: {_HOW}"
        )
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            continue
        if not is_dtensor(parameter):
            raise ShardedLayoutError(
                f"rank {rank}: parameter '{name}' is not sharded (a plain tensor) while the model is wrapped as "
                "sharded replicas; call fully_shard(model, mesh=mesh['shard']) on the root module too, so that "
                "every trainable parameter is a shard"
            )
        mesh = parameter.device_mesh
        if mesh.ndim != 1:
            raise ShardedLayoutError(
                f"rank {rank}: parameter '{name}' is sharded over a {mesh.ndim}-D mesh "
                f"{tuple(mesh.mesh_dim_names or ())} (HSDP): FSDP would then average the gradients across the "
                "replicas, which is DDP, not gossip. Pass only the shard dimension: fully_shard(..., "
                "mesh=mesh['shard'])"
            )
        ranks = mesh.mesh.flatten().tolist()
        if ranks != list(replica_ranks):
            raise ShardedLayoutError(
                f"rank {rank}: parameter '{name}' is sharded over ranks {ranks}, but this rank's replica is ranks "
                f"{list(replica_ranks)} (the 'shard' row of the mesh given to gossip.init_lanes); shard with "
                "fully_shard(..., mesh=mesh['shard']) of that same mesh"
            )
        placements = tuple(parameter.placements)
        if len(placements) != 1 or not isinstance(placements[0], Shard):
            raise ShardedLayoutError(
                f"rank {rank}: parameter '{name}' has placements {placements}; the sharded wrapper mixes "
                "FSDP2's Shard(d) shards only"
            )


def local_shards(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The local shard of each DTensor parameter (``to_local()``: a view of FSDP's storage, no copy).

    Args:
        parameters: DTensor parameters.

    Returns:
        Their local tensors, in order.
    """
    return [parameter.to_local() for parameter in parameters]


class Staging:
    """Flat buckets laid out like the local shards: what the algorithm mixes, copied from and to the shards.

    Args:
        named: ``(name, parameter)`` of the trainable DTensor parameters, in order.
        bucket_bytes: the size a bucket fills up to (:func:`gossip.algorithms.buckets.pack`).
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int):
        self.parameters = [parameter for _, parameter in named]
        with torch.no_grad():
            self.buckets: list[Bucket] = pack(
                [(name, shard) for (name, _), shard in zip(named, local_shards(self.parameters), strict=True)],
                bucket_bytes,
            )
        self.views = [bucket.view(entry) for bucket in self.buckets for entry in bucket.entries]

    def fill(self) -> None:
        """Copy the local shards into the staging (before an exchange starts)."""
        with torch.no_grad():
            torch._foreach_copy_(self.views, local_shards(self.parameters))

    def write_back(self) -> None:
        """Copy the staging into the local shards (after the mixing wrote it)."""
        with torch.no_grad():
            torch._foreach_copy_(local_shards(self.parameters), self.views)
