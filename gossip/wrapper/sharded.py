r"""``ShardedDecentralizedDataParallel``: gossip between sharded replicas, shard to shard, lane by lane.

The world is R replicas × G shards on a ``("replicate", "shard")`` DeviceMesh; FSDP2 shards each replica over
``mesh["shard"]`` and never sees ``"replicate"`` (:mod:`gossip.backends.lanes`). Rank j of every replica forms
lane j, and every lane runs the same gossip, over the same W(t) of the replicas, on its own rows: with
:math:`x_{i} = [x_{i,1}; \dots; x_{i,G}]` the rows of replica i as FSDP2 shards them (``Shard(d)``, per
parameter),

.. math::  x_{i,j}^{t+1} = \sum_k W_{ik}(t)\, x_{k,j}^{t} \;-\; \eta\, d_{i,j}^{t}

so exact gossip of the shards *is* exact gossip of the replicas (an element-wise weighted sum: the same numbers
term by term as the unsharded wrapper's), and the sum over replicas is preserved lane by lane, hence as a whole.
The update :math:`d_{i,j}` is the optimizer's on the shard, from the gradient FSDP2 reduce-scattered within
replica i only.

PowerGossip (Vogels et al. 2020, arXiv 2008.01425, Alg. 1) runs in *block* mode: the unchanged algorithm on each
lane's local shard :math:`X_{i,j}` as a matrix of its own, with the given rank per block, so the mixing of the
whole replica has rank up to G·r; no collective inside a replica, and both ends of an edge hold bit-identical
factors and preserve the lane's sum exactly as unsharded. Its result depends on G (a G = 8 run is not a G = 1 run
with the same rank).

Supported so far: exact gossip and PowerGossip's block mode on the shards, ``averaged()``, the consensus
distance over lanes, and checkpoints through ``torch.distributed.checkpoint``, one per replica
(:mod:`gossip.checkpoint.sharded`; ``save_checkpoint`` and ``save_dcp`` refuse a sharded wrapper); the tests are
tests/test_sharded.py. Gradient tracking (``gradient_tracking=True``, as for the unsharded wrapper) tracks each
lane's rows: the trackers are laid out like the staging, read the local shard of each FSDP2 gradient and write
:math:`y_{i,j}` back into it, so that :math:`\sum_i y_{i,j} = \sum_i g_{i,j}` lane by lane, hence for the whole
replicas. Momentum tracking works the same way: a momentum-tracking optimizer (``optim.MomentumTrackingAdamW``)
steps on FSDP2's DTensors, its first moment goes through those trackers, and the mean gradient's sample for its
second moment (``mean_gradient``) is formed from the local shards and averaged lane by lane, so each rank holds its
shard of the mean gradient of the whole replicas, handed to the optimizer as DTensors. Not yet: PowerGossip's
"global" mode.

The backward hooks of the unsharded wrapper (a skipped update noticed at the next forward, PowerGossip's progress
during backward) are post-accumulate-grad hooks on the trainable parameters; FSDP2 assigns the reduce-scattered
gradient to the sharded parameter rather than accumulating it through autograd, and then runs that parameter's
post-accumulate-grad hooks itself (``torch.distributed.fsdp``'s reduce-scatter, torch 2.13), so they fire once per
parameter and backward as unsharded; the tests pin it.

What changes against :class:`gossip.DecentralizedDataParallel`, of which this is the sharded mode:

* the parameters stay FSDP2's DTensors over their own storage. The algorithm mixes a staging copy laid out like
  the local shards (:class:`gossip.wrapper.shard_layout.Staging`), filled from the shards just before each exchange
  starts and written back into them right after the mixing, before the optimizer's update; after the write-back
  the parameters are the same ``Shard(d)`` DTensors, and the next forward's all-gather reads the mixed values;
* construction also checks, over the shard group, that every lane runs the same schedule, algorithm and settings,
  and refuses a model that FSDP2 does not shard over exactly this replica
  (:func:`gossip.wrapper.shard_layout.check_sharded_module`);
* ``averaged()`` writes the average of each lane into the shards for the block and restores them exactly on exit
  (the module then holds the average as DTensors: evaluate it, or save it with torch.distributed.checkpoint);
* the consensus distances sum each lane's squares over the shard group: :math:`\Xi^2 = \sum_j \Xi_j^2`;
* frozen parameters (DTensors as well) start from replica 0's local shards, broadcast over each lane;
* checkpoints are one DCP directory per replica (:func:`gossip.checkpoint.sharded.save_sharded_dcp`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import DEFAULT_BUCKET_BYTES, Bucket
from gossip.backends.base import Communicator
from gossip.backends.lanes import Lanes
from gossip.errors import ArgumentTypeError, InvalidArgumentError, ShardedLayoutError
from gossip.wrapper.buffer_average import float_buffers
from gossip.wrapper.consensus import DEFAULT_SAMPLES, _all_reduce_on, exact_consensus_sq, global_average, reading
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.replicas import check_replicas, first_difference
from gossip.wrapper.shard_layout import Staging, check_sharded_module, is_dtensor, local_shards
from topologies import Schedule


class _LocalGradient:
    """A DTensor parameter seen through its local shard: ``.grad`` is the local shard of its gradient.

    What the gradient tracker (:class:`gossip.wrapper.tracking.GradientTracker`) reads and writes in place of the
    parameter: its buffers are laid out like the staging, i.e. like the local shards, and FSDP2's gradient of a
    ``Shard(d)`` parameter is a DTensor of the same placement whose local tensor holds this rank's rows.
    """

    __slots__ = ("parameter",)

    def __init__(self, parameter: torch.Tensor):
        self.parameter = parameter

    @property
    def grad(self) -> torch.Tensor | None:
        grad = self.parameter.grad
        return None if grad is None else grad.to_local()

    @grad.setter
    def grad(self, local: torch.Tensor) -> None:
        self.parameter.grad = self.lift(local)

    def lift(self, local: torch.Tensor) -> torch.Tensor:
        """The DTensor sharded like the parameter whose local shard is ``local`` (no copy)."""
        from torch.distributed.tensor import DTensor

        parameter = self.parameter
        return DTensor.from_local(
            local, parameter.device_mesh, parameter.placements, shape=parameter.shape, stride=parameter.stride()
        )


class _OnShards:
    """A momentum-tracking optimizer as the wrapper's mean-gradient sampler sees it on shards.

    The sampler reads the local shards of the gradients (through :class:`_LocalGradient`) and averages them over the
    lane; each rank's sample is then its shard of the mean gradient of the whole replicas, which this hands to the
    optimizer as DTensors sharded like the parameters, keyed by the parameters (the optimizer's state is FSDP2's
    DTensors). Everything else is the optimizer's.
    """

    def __init__(self, source: Any):
        self._source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def take_mean_gradient(self, means: Mapping[_LocalGradient, torch.Tensor], workers: int) -> None:
        self._source.take_mean_gradient({local.parameter: local.lift(v) for local, v in means.items()}, workers)


class _SummedOverLanes:
    """The consensus sampler of one lane, its squared estimate summed over the shard group (a collective)."""

    def __init__(self, sampler: Any, shard: Communicator):
        self._sampler, self._shard = sampler, shard

    def estimate_sq(self, tensors: Sequence[torch.Tensor], comm: Communicator, step: int) -> float:
        return _sum_over(self._shard, self._sampler.estimate_sq(tensors, comm, step))


def _sum_over(comm: Communicator, value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    _all_reduce_on(comm, total, "sum")
    return float(total[0])


def check_lanes(shard: Communicator, signature: dict, replica: int) -> None:
    """Refuse lanes that disagree on the schedule, the algorithm, the settings or the model.

    A collective over the shard group (every rank of a replica).

    Args:
        shard: the communicator of this rank's replica (rank = lane).
        signature: this lane's run signature (:func:`gossip.wrapper.replicas.run_signature`).
        replica: this rank's replica index, for the message.

    Raises:
        ShardedLayoutError: on every rank of the replica, naming the first lane that differs from lane 0.
    """
    gathered = shard.all_gather_object(signature)
    for lane, theirs in enumerate(gathered):
        difference = first_difference(theirs, gathered[0], f"lane {lane}", "lane 0")
        if difference is not None:
            raise ShardedLayoutError(
                f"replica {replica}: the lanes of one replica must run one schedule in lockstep, but {difference}; "
                "build the same schedule, algorithm and settings on every rank"
            )


class ShardedDecentralizedDataParallel(DecentralizedDataParallel):
    """Gossip between FSDP2-sharded replicas: each rank mixes its local shards with the same shards of its peers.

    Usage (every rank)::

        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(net, mesh=mesh["shard"])
        lanes = gossip.init_lanes(mesh)
        model = ShardedDecentralizedDataParallel(net, lanes, topologies.ring(replicas), gossip.ExactGossip())
        optimizer = torch.optim.AdamW(model.parameters())   # the loop is the ordinary one

    Construction is a collective over the world (lanes and shard groups). It checks what
    :class:`gossip.DecentralizedDataParallel` checks over each lane, on the global shapes, plus the sharded layout
    and the lanes' agreement; copies replica 0's shards (lane rank 0) to every replica; and binds ``algorithm`` to
    the lane and the staging buckets.

    Args:
        module: the model, every trainable parameter sharded by ``fully_shard(..., mesh=mesh["shard"])``.
        lanes: this rank's communicators (:func:`gossip.init_lanes`); ``lanes.lane.size`` is the schedule's n.
        schedule: W(t) over the replicas, the same on every rank.
        algorithm: how the shards are mixed (``ExactGossip()``, ``PowerGossip(...)`` in block mode), the same
            on every rank.
        bucket_bytes: the size of one staging bucket in bytes.
        buffers: ``"local"`` or ``"average"`` (over the lane), as for the unsharded wrapper.
        run_dir: metrics directory; pass it on one lane (e.g. lane 0) only, or give each lane its own.
        consensus_every: sample the consensus distance every this many steps (0: off).
        consensus_samples: coordinates sampled per lane.
        seed: the seed of the sampled coordinates.
        gradient_tracking: as for the unsharded wrapper (``True``, ``"exact"``, ``"powergossip"`` or an algorithm
            object), on the local shards of the gradients; the same on every rank.
        tracking_overlap: as for the unsharded wrapper (the combine-then-adapt tracker).
        tracker_hops: as for the unsharded wrapper (the trackers' exchanges a step).
        mean_gradient: with gradient tracking, how a momentum-tracking optimizer's sample of the mean gradient is
            averaged: ``"gossip"`` over the schedule, lane by lane, or ``"allreduce"`` over the lane.
        mean_gradient_dtype: the dtype the gossiped sample's hops travel in, as for the unsharded wrapper.

    Raises:
        ShardedLayoutError: the model is not sharded by FSDP2 over exactly this replica (or is FSDP1, or HSDP),
            or the lanes disagree.
        InvalidArgumentError: ``lanes`` is not a :class:`gossip.backends.lanes.Lanes`.
        ReplicaMismatchError: the replicas of a lane disagree (as for the unsharded wrapper).
    """

    _shards_replicas = True

    def __init__(
        self,
        module: nn.Module,
        lanes: Lanes,
        schedule: Schedule,
        algorithm: Algorithm,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        buffers: str = "local",
        run_dir: str | Path | None = None,
        consensus_every: int = 10,
        consensus_samples: int = DEFAULT_SAMPLES,
        seed: int = 0,
        gradient_tracking: bool | str | Algorithm = False,
        tracking_overlap: bool = False,
        tracker_hops: int = 1,
        mean_gradient: str = "gossip",
        mean_gradient_dtype: torch.dtype | None = torch.bfloat16,
    ):
        if not isinstance(lanes, Lanes):
            raise InvalidArgumentError(
                f"lanes must be the gossip.init_lanes(mesh) result (lane and shard communicators), got "
                f"{type(lanes).__name__}"
            )
        self._lanes = lanes
        check_sharded_module(module, lanes.replica_ranks, lanes.world_rank)
        super().__init__(
            module,
            lanes.lane,
            schedule,
            algorithm,
            bucket_bytes=bucket_bytes,
            buffers=buffers,
            run_dir=run_dir,
            consensus_every=consensus_every,
            consensus_samples=consensus_samples,
            seed=seed,
            gradient_tracking=gradient_tracking,
            tracking_overlap=tracking_overlap,
            tracker_hops=tracker_hops,
            mean_gradient=mean_gradient,
            mean_gradient_dtype=mean_gradient_dtype,
        )
        # the tracker and the mean gradient's sampler read (and the tracker writes) the local shards of the gradients
        local = [_LocalGradient(p) for p in self._parameters_in_order]
        if self.tracker is not None:
            self.tracker._parameters = local
        if self._mean_gradient is not None:
            self._mean_gradient.parameters = local
        self.shard_comm = lanes.shard
        self._sampler = _SummedOverLanes(self._sampler, lanes.shard)

    # -- the parent's hooks --------------------------------------------------------------------------------
    def _check_run(
        self, module: nn.Module, comm: Communicator, schedule: Schedule, algorithm: Algorithm, settings: dict
    ) -> dict:
        """The lane's replicas agree (global shapes, as unsharded), then the replica's lanes agree."""
        settings = {**settings, "shards": self._lanes.shard.size}
        signature = check_replicas(module, comm, schedule, algorithm, settings)
        check_lanes(self._lanes.shard, signature, comm.rank)
        return signature

    def _finish_tracking(self, momentum: Any) -> None:
        """The parent's; a momentum-tracking optimizer gets its mean gradient as DTensors (:class:`_OnShards`)."""
        super()._finish_tracking(None if momentum is None else _OnShards(momentum))

    def _make_buckets(self, module: nn.Module, bucket_bytes: int) -> list[Bucket]:
        """Staging buckets laid out like the local shards; the parameters keep FSDP2's storage."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._staging = Staging(named, bucket_bytes)
        return self._staging.buckets

    def _broadcast_initial(self) -> None:
        """Replica 0's shards (the lane's rank 0), frozen parameters and buffers, to every replica of the lane.

        As :func:`gossip.wrapper.replicas.broadcast_from_rank0`, on the local shards: the staging (then written into
        the trainable shards), the local shard of each frozen DTensor parameter (FSDP2 shards those too) and the
        buffers (FSDP2 leaves them whole on every rank).
        """
        frozen = [p for _, p in self.module.named_parameters() if not p.requires_grad]
        buffers = [b for _, b in self.module.named_buffers()]
        for bucket in self.buckets:
            self.comm.broadcast(bucket.buffer, 0)
        with torch.no_grad():
            for tensor in [*(p.to_local() if is_dtensor(p) else p for p in frozen), *buffers]:
                contiguous = tensor if tensor.is_contiguous() else tensor.contiguous()
                self.comm.broadcast(contiguous, 0)
                if contiguous is not tensor:
                    tensor.copy_(contiguous)
        self._staging.write_back()

    def _address(self, parameter: torch.Tensor) -> int:
        """A DTensor's values live in its local shard (FSDP2's storage)."""
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        return local.data_ptr()

    def _replica_tensors(self) -> list[torch.Tensor]:
        """The local shards themselves (what this rank holds of its replica)."""
        return local_shards(self._staging.parameters)

    def _start(self) -> None:
        """Fill the staging from the shards (x_t after step t-1's update), then start its exchange."""
        self._staging.fill()
        super()._start()

    def _finish_mixing(self) -> None:
        """Mix the staging, then write it into the shards, before the optimizer's update."""
        super()._finish_mixing()
        self._staging.write_back()

    #: set by :mod:`gossip.checkpoint.sharded` while it saves or loads (:meth:`checkpointing`)
    _checkpointing = False

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """For :mod:`gossip.checkpoint.sharded`: lets :meth:`training_state` and :meth:`load_training_state` run.

        Yields:
            Nothing; inside the block the two methods are allowed.
        """
        self._checkpointing = True
        try:
            yield
        finally:
            self._checkpointing = False

    def _refuse_unsharded_checkpoint(self, operation: str) -> None:
        if not self._checkpointing:
            raise ArgumentTypeError(
                f"rank {self._lanes.world_rank} (replica {self.comm.rank}, shard {self.shard_comm.rank}): "
                f"{operation} of sharded replicas goes through gossip.checkpoint.sharded.save_sharded_dcp / "
                "load_sharded_dcp (one DCP checkpoint per replica); save_checkpoint and save_dcp name their files "
                "by the lane rank, so the shards of one replica would overwrite each other's"
            )

    def training_state(self) -> dict[str, Any]:
        """:meth:`DecentralizedDataParallel.training_state`, inside :mod:`gossip.checkpoint.sharded` only.

        Returns:
            This rank's gossip state (its staging as the buckets).

        Raises:
            ArgumentTypeError: called by another checkpoint than :func:`gossip.checkpoint.sharded.save_sharded_dcp`.
        """
        self._refuse_unsharded_checkpoint("a checkpoint")
        return super().training_state()

    def load_training_state(self, state: dict[str, Any]) -> None:
        """:meth:`DecentralizedDataParallel.load_training_state`, then the restored staging into the shards.

        Args:
            state: what :meth:`training_state` returned on this rank (same lane, same shard).

        Raises:
            ArgumentTypeError: called by another load than :func:`gossip.checkpoint.sharded.load_sharded_dcp`.
        """
        self._refuse_unsharded_checkpoint("loading a checkpoint")
        super().load_training_state(state)
        self._staging.write_back()

    # -- evaluation and consensus ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def averaged(self, buffers: bool = False) -> Iterator[nn.Module]:
        """Let the module's shards hold the average over the replicas within the block. A collective (world).

        Each lane averages its shards (``all_reduce`` over the lane); the averages are written into the local
        shards for the block, and the shards' own values, kept aside, are written back on exit, bit for bit. The
        staging, which an exchange in flight sends, is not touched, so training continues as without the block.

        Args:
            buffers: average the floating-point buffers too.

        Yields:
            The module, whose DTensor parameters hold the average.
        """
        self._require_usable("averaged()")
        self._settle_exchange()
        shards = local_shards(self._staging.parameters)
        own = [shard.detach().clone() for shard in shards]
        average = global_average(shards, self.comm)
        targets, values = [], []
        if buffers:
            targets = [b for _, b in float_buffers(self.module)]
            values = global_average(targets, self.comm)
        self._averaging = True
        try:
            with torch.no_grad():
                torch._foreach_copy_(shards, average)
            with reading(targets, values):
                yield self.module
        finally:
            with torch.no_grad():
                torch._foreach_copy_(shards, own)
            self._averaging = False

    def consensus_distance(self) -> float:
        """Exact consensus distance of the whole replicas, :math:`\\sqrt{\\sum_j \\Xi_j^2}`. A collective (world).

        Returns:
            Xi, the same on every rank.
        """
        self._require_usable("consensus_distance()")
        self._settle_exchange()
        return math.sqrt(_sum_over(self.shard_comm, exact_consensus_sq(self._replica_views, self.comm)))
