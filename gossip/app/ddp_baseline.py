r"""The All-Reduce baseline as users run it: ``torch.nn.parallel.DistributedDataParallel`` behind the surface the
training loop uses from :class:`gossip.wrapper.parallel.DecentralizedDataParallel`.

DDP all-reduces the *gradients* in buckets while backward still runs, so every replica applies the same update
(docs/design.md B.5, "All-Reduce (DDP, bucket all-reduce overlapped with backward)"):

.. math::  x^{t+1} = x^t - \eta\, d\Big(\tfrac{1}{n} \textstyle\sum_i g_i(x^t)\Big)

and the replicas stay identical (consensus distance 0). Bytes sent per worker and step are those of a ring
all-reduce of the gradient buckets, :math:`2 (n-1)/n \cdot M` (B.5, :math:`T_{AR}`); Gloo may pick another
algorithm internally, the count is the standard model, not a packet capture.

Exposed communication (``wait_seconds``) is estimated from DDP's communication hook: the time from the last
bucket becoming ready (backward has produced every gradient by then) to the completion of the last bucket's
all-reduce, clipped at 0 -- the part of the all-reduce that backward did not hide.

DDP runs on its own Gloo group (a new group over all ranks of the default process group that
:func:`gossip.init` created), so its bucket all-reduces never interleave with the communicator's collectives
(validation loss, consensus distance). The model stays on the CPU in the main job, so the group is Gloo even when
the default group is NCCL; a model on a GPU gets an NCCL group.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gossip.backends.base import Communicator, ring_all_reduce_bytes
from gossip.errors import DDPBackendError, InvalidArgumentError
from gossip.wrapper import optimizer_hooks
from gossip.wrapper.consensus import exact_consensus_sq
from gossip.wrapper.metrics import StepMetrics


class DDPBaseline:
    """Torch DDP around ``module`` with DecentralizedDataParallel's loop surface.

    That surface is ``model(x, y)``, ``.module``, ``log(**values)``, ``averaged()``, ``consensus_distance()`` and
    ``close()``. Construction is a collective (it creates DDP's process group and broadcasts rank 0's parameters).
    Per-step metrics rows (:class:`gossip.wrapper.metrics.StepMetrics`, same columns as the wrapper's) are recorded at
    every step of any optimizer over ``module``'s parameters (through :mod:`gossip.wrapper.optimizer_hooks`, as the
    wrapper does).

    Args:
        module: the model.
        comm: a communicator with a torch.distributed process group (Gloo or NCCL).
        run_dir: where this rank writes its metrics, or None.
        consensus_every: the exact consensus distance every this many steps (one all-reduce of the parameters;
            0 turns it off).
        bucket_cap_mb: DDP's gradient bucket size in MiB.

    Raises:
        DDPBackendError: ``comm`` has no torch.distributed process group (e.g. MPI).
        InvalidArgumentError: ``consensus_every`` is negative.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        run_dir: str | Path | None = None,
        consensus_every: int = 10,
        bucket_cap_mb: float = 25.0,
    ):
        if (
            not dist.is_available()
            or not dist.is_initialized()
            or getattr(comm, "backend", None)
            not in (
                "gloo",
                "nccl",
            )
        ):
            raise DDPBackendError(
                f"--backend: rank {comm.rank}: --algorithm ddp needs a torch.distributed process group (Gloo or "
                f"NCCL), but this communicator is {type(comm).__name__}; use --backend gloo (or nccl)"
            )
        if consensus_every < 0:
            raise InvalidArgumentError(
                f"rank {comm.rank}: consensus_every must be >= 0 (0 = off), got {consensus_every}"
            )
        self.comm = comm
        self.module = module
        on_gpu = any(p.is_cuda for p in module.parameters())
        self.group = dist.new_group(list(range(comm.size)), backend="nccl" if on_gpu else "gloo")
        self.ddp = DistributedDataParallel(module, process_group=self.group, bucket_cap_mb=bucket_cap_mb)
        # a lambda: DDP rejects a hook whose (string, postponed) annotations are not the GradBucket class itself
        self.ddp.register_comm_hook(self.group, lambda group, bucket: self._all_reduce_bucket(group, bucket))
        self._parameters = [p for p in module.parameters() if p.requires_grad]
        self._parameter_ids = {id(p) for p in self._parameters}
        self.metrics = StepMetrics(run_dir, comm.rank)
        self.consensus_every = consensus_every if run_dir is not None else 0
        self.step_count = 0
        self._bucket_bytes = 0
        self._ready_at: list[float] = []
        self._done_at: list[float] = []
        self._forward_at = self._last_step_end = math.nan
        self._timing: dict[str, float] = {}
        optimizer_hooks.subscribe(self)

    # -- the loop -------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run DDP's forward (its backward all-reduces the gradients).

        Args:
            *args: positional arguments of the module's forward.
            **kwargs: keyword arguments of the module's forward.

        Returns:
            What the module returns.
        """
        self.metrics.flush()
        if math.isnan(self._forward_at):
            self._forward_at = time.perf_counter()
            if math.isnan(self._last_step_end):
                self._last_step_end = self._forward_at
        return self.ddp(*args, **kwargs)

    def log(self, **values: Any) -> None:
        """Add ``values`` to this step's metrics row (see :meth:`StepMetrics.note`).

        Args:
            **values: the row's entries, e.g. ``loss=loss``.
        """
        self.metrics.note(**values)

    def _all_reduce_bucket(self, group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future:
        """DDP's default all-reduce (average) of one bucket, timed: when it was ready and when it completed."""
        self._ready_at.append(time.perf_counter())
        buffer = bucket.buffer()
        self._bucket_bytes += buffer.numel() * buffer.element_size()

        def completed(future: torch.futures.Future) -> torch.Tensor:
            self._done_at.append(time.perf_counter())
            return future.value()

        return allreduce_hook(group, bucket).then(completed)

    # -- the optimizer-step hooks (gossip.wrapper.optimizer_hooks calls these) ---------------------------------
    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """True when ``optimizer`` trains any of the module's parameters.

        Args:
            optimizer: an optimizer about to step.

        Returns:
            Whether its steps concern this baseline.
        """
        return any(id(p) in self._parameter_ids for group in optimizer.param_groups for p in group["params"])

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, computes_gradients: bool) -> None:
        """Note the step's timing: compute since the first forward, and the all-reduce backward did not hide.

        Args:
            optimizer: the optimizer that steps.
            computes_gradients: a closure was passed (unused: DDP's all-reduce runs in the backward).
        """
        now = time.perf_counter()
        exposed = max(0.0, max(self._done_at) - max(self._ready_at)) if self._done_at and self._ready_at else 0.0
        compute_from = self._forward_at if not math.isnan(self._forward_at) else now
        self._timing = {"compute_seconds": now - compute_from, "wait_seconds": exposed, "finish_seconds": exposed}

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Record step t's metrics row (the replicas applied the same update) and advance to t + 1.

        Args:
            optimizer: the optimizer that stepped.
        """
        now = time.perf_counter()
        sent = ring_all_reduce_bytes(self._bucket_bytes, self.comm.size)
        timing = self._timing or {"compute_seconds": 0.0, "wait_seconds": 0.0, "finish_seconds": 0.0}
        row = {
            "step": self.step_count,
            "lr": optimizer.param_groups[0].get("lr"),
            **timing,
            "step_seconds": now - (self._last_step_end if not math.isnan(self._last_step_end) else now),
            "bytes_sent": sent,
            "bytes_received": sent,
        }
        if self.consensus_every and (self.step_count + 1) % self.consensus_every == 0:
            row["consensus"] = self.consensus_distance()
        self.metrics.record(row)
        self.step_count += 1
        self._bucket_bytes, self._ready_at, self._done_at, self._timing = 0, [], [], {}
        self._forward_at = math.nan
        self._last_step_end = time.perf_counter()

    # -- evaluation and consensus ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def averaged(self, buffers: bool = False) -> Iterator[nn.Module]:
        """The replicas are identical under DDP: the module itself is the average. Not a collective.

        Args:
            buffers: accepted for the wrapper's signature; the buffers are the module's own.

        Yields:
            The module.
        """
        yield self.module

    def consensus_distance(self) -> float:
        """Exact consensus distance Xi = sqrt((1/n) sum_i ||x_i - xbar||^2) (0 for DDP up to rounding).

        A collective: one all-reduce of the parameters in float64.

        Returns:
            Xi, the same on every rank.
        """
        flat = torch.cat([p.detach().reshape(-1) for p in self._parameters])
        return math.sqrt(exact_consensus_sq([flat], self.comm))

    # -- teardown -------------------------------------------------------------------------------------------
    def close(self) -> dict[str, float] | None:
        """Stop following the optimizer steps and summarise the metrics (a collective).

        Returns:
            The summary on rank 0, None elsewhere.
        """
        optimizer_hooks.unsubscribe(self)
        summary = self.metrics.summarize(self.comm)
        self.metrics.close()
        return summary
