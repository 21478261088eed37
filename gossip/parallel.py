r"""``DecentralizedDataParallel``: the wrapper that puts gossip into an ordinary PyTorch training loop.

The order of one step (docs/design.md B.1 and G; Decent-DP's schema, arXiv 2410.11998):

.. math::  x_i^{t+1} = \sum_j W_{ij}(t)\, x_j^{t} \;-\; \eta\, d_i^{t}\big(g_i(x_i^{t})\big)

1. the exchange of :math:`x^t` with step t's peers starts right after step t-1's ``optimizer.step()`` (for t = 0
   at the first forward) -- ``algorithm.start(t)``;
2. forward and backward at :math:`x_i^t` run while it is in flight;
3. at ``optimizer.step()`` the wrapper first completes the exchange and writes the mixed parameters
   :math:`\sum_j W_{ij} x_j^t` -- ``algorithm.finish`` -- then the optimizer applies its update computed from
   :math:`g_i(x_i^t)`.

Steps 1 and 3 run from torch.optim's global step hooks, filtered to optimizers over this wrapper's parameters,
so any ``torch.optim.Optimizer`` created after wrapping works unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gossip.algorithms.base import Algorithm
from gossip.backends.base import Communicator
from gossip.buckets import DEFAULT_BUCKET_BYTES, bucket_parameters, pack
from gossip.consensus import DEFAULT_SAMPLES, ConsensusSampler, averaged_replicas, exact_consensus_sq
from gossip.errors import GossipError
from gossip.metrics import StepMetrics
from gossip.replicas import broadcast_from_rank0, check_replicas
from topologies import Schedule

BUFFER_POLICIES = ("local", "average")

# One pair of torch.optim global step hooks per process dispatches to the live wrappers. Registering per wrapper
# would mutate torch's global hook dict while another thread (a simulator rank) iterates it in optimizer.step().
_lock = threading.Lock()
_live: weakref.WeakSet = weakref.WeakSet()
_global_hooks: list[Any] = []


def _live_wrappers() -> list[DecentralizedDataParallel]:
    with _lock:
        return list(_live)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # An optimizer subclass whose step() calls super().step() fires the hooks once per level: act on the outermost.
    for wrapper in _live_wrappers():
        if wrapper._owns(optimizer):
            wrapper._step_depth += 1
            if wrapper._step_depth == 1:
                wrapper.finish_mixing()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for wrapper in _live_wrappers():
        if wrapper._owns(optimizer):
            if wrapper._step_depth == 1:
                wrapper.next_step(lr=optimizer.param_groups[0].get("lr"))
            wrapper._step_depth = max(0, wrapper._step_depth - 1)


def _subscribe(wrapper: DecentralizedDataParallel) -> None:
    with _lock:
        _live.add(wrapper)
        if not _global_hooks:
            _global_hooks.extend(
                [register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step)]
            )


def _unsubscribe(wrapper: DecentralizedDataParallel) -> None:
    with _lock:
        _live.discard(wrapper)
        if not _live:
            for hook in _global_hooks:
                hook.remove()
            _global_hooks.clear()


class DecentralizedDataParallel(nn.Module):
    """Gossip data parallelism around ``module``: each rank keeps its own replica and mixes it with its peers.

    Construction (a collective: every rank constructs its wrapper at the same point) checks that all ranks have
    the same parameter and buffer names, shapes, dtypes and device types, the same schedule (fingerprint) and
    algorithm config, and a schedule of ``comm.size`` ranks (else :class:`gossip.replicas.ReplicaMismatchError`
    on every rank, naming the rank and the first difference); copies rank 0's parameters and buffers to all;
    moves the parameters into flat buckets (they become views; create the optimizer *after* wrapping); and binds
    ``algorithm`` to ``comm``, ``schedule`` and the buckets.

    The loop stays ordinary::

        model = DecentralizedDataParallel(net, comm, schedule, ExactGossip())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)   # first forward of the step: x_t's exchange is already in flight
            loss.backward()
            optimizer.step()                       # mixes x_t with the peers, then applies the update
            optimizer.zero_grad()
            model.log(loss=loss)                   # optional: adds the loss to this step's metrics row

    Gradient accumulation needs nothing special: several forward/backward passes before one
    ``optimizer.step()`` are one gossip step (the exchange is started once and completed once)::

        for micro_batches in loader:               # e.g. 4 micro-batches per optimizer step
            for x, y in micro_batches:
                (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
            optimizer.step()
            optimizer.zero_grad()

    Without a torch optimizer, drive the step by hand: ``model.finish_mixing()`` before the update and
    ``model.next_step()`` after it (this is what the hooks call).

    ``buffers``: ``"local"`` (default) never mixes buffers (BatchNorm statistics stay per rank, as in Decent-DP);
    ``"average"`` all-reduces the floating-point buffers to their average at every step, blocking, right after
    the mixing (integer buffers such as ``num_batches_tracked`` stay local).

    Metrics: with ``run_dir`` every rank appends one JSON line per step (see :mod:`gossip.metrics`), including the
    sampled consensus distance every ``consensus_every`` steps (one small all-reduce of ``2 * consensus_samples``
    float64 values; 0 turns it off). ``close()`` removes the hooks, completes an in-flight exchange and returns the
    summary on rank 0.

    One optimizer must cover all of the wrapper's trainable parameters (a partial one is refused at its first
    ``step``); parameters added to it later with ``add_param_group`` are not seen. An optimizer subclass whose
    ``step`` calls ``super().step()`` is one step (the outermost call counts). If ``optimizer.step()`` raises, torch
    skips the post-hooks and this wrapper's step is left open: do not continue training with this wrapper.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        schedule: Schedule,
        algorithm: Algorithm,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        buffers: str = "local",
        run_dir: str | Path | None = None,
        consensus_every: int = 10,
        consensus_samples: int = DEFAULT_SAMPLES,
        seed: int = 0,
    ):
        super().__init__()
        if buffers not in BUFFER_POLICIES:
            raise ValueError(f"rank {comm.rank}: buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"rank {comm.rank}: bucket_bytes must be positive, got {bucket_bytes}")
        if consensus_every < 0:
            raise ValueError(f"rank {comm.rank}: consensus_every must be >= 0 (0 = off), got {consensus_every}")
        self.module = module
        self.comm, self.schedule, self.algorithm = comm, schedule, algorithm
        self.buffers_policy = buffers
        self.signature = check_replicas(module, comm, schedule, algorithm)
        self.buckets = bucket_parameters(module, bucket_bytes)
        algorithm.setup(comm, schedule, self.buckets)  # refuses a bad schedule or configuration on every rank
        broadcast_from_rank0(module, self.buckets, comm)

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._parameters_in_order = [p for _, p in named]
        self._names = {id(p): name for name, p in named}
        self._ownership: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.step_count = 0
        self._pending: Any = None
        self._mixed: list[torch.Tensor] | None = None  # step t's mixing, completed early (see _complete_pending)
        self._mixing_done = False
        self._step_depth = 0  # nesting of optimizer.step() calls (subclasses calling super().step())
        self._state_before_start = copy.deepcopy(algorithm.state_dict())

        self.metrics = StepMetrics(run_dir, comm.rank)
        self.consensus_every = consensus_every if run_dir is not None else 0
        self._sampler = ConsensusSampler([p.numel() for p in self._parameters_in_order], consensus_samples, seed)
        self._started_at = self._last_step_end = math.nan
        self._timing = {"compute_seconds": 0.0, "wait_seconds": math.nan, "finish_seconds": 0.0}

        _subscribe(self)

    # -- the loop -------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.metrics.flush()
        if self._pending is None and self._mixed is None and not self._mixing_done:
            self._start()
        return self.module(*args, **kwargs)

    def log(self, **values: Any) -> None:
        """Add ``values`` (e.g. ``loss=loss``) to this step's metrics row: call it before ``optimizer.step()``, or
        after it and before the next forward (see :meth:`gossip.metrics.StepMetrics.note`)."""
        self.metrics.note(**values)

    def finish_mixing(self) -> None:
        """Complete step t's exchange and write the mixed parameters (called before the optimizer's update).

        Idempotent within a step. When no exchange is in flight (no forward this step) it runs one blocking.
        """
        if self._mixing_done:
            return
        with self._naming_step():
            self._finish_mixing()

    def _finish_mixing(self) -> None:
        self.metrics.flush()
        if self._pending is None and self._mixed is None:
            self._start()
        self._timing["compute_seconds"] = time.perf_counter() - self._started_at
        begin = time.perf_counter()
        if self._mixed is not None:
            with torch.no_grad():
                for bucket, mixed in zip(self.buckets, self._mixed, strict=True):
                    bucket.buffer.copy_(mixed)
            self._timing["wait_seconds"] = 0.0
        else:
            self.algorithm.finish(self._pending)
            self._timing["wait_seconds"] = self.algorithm.wait_seconds
        self._timing["finish_seconds"] = time.perf_counter() - begin
        self._pending, self._mixed, self._mixing_done = None, None, True
        if self.buffers_policy == "average":
            self._average_buffers()

    def next_step(self, **values: Any) -> None:
        """End step t after the update: record its metrics, advance to t + 1 and start x_{t+1}'s exchange."""
        if not self._mixing_done:
            raise RuntimeError(
                f"rank {self.comm.rank}: next_step() at step {self.step_count} before finish_mixing(); "
                "call finish_mixing() before the update"
            )
        now = time.perf_counter()
        traffic = self.algorithm.traffic
        row = {
            "step": self.step_count,
            **values,
            **self._timing,
            "step_seconds": now - self._last_step_end,
            "bytes_sent": sum(traffic.last_sent.values()),
            "bytes_received": sum(traffic.last_received.values()),
        }
        if self.consensus_every and (self.step_count + 1) % self.consensus_every == 0:
            with self._naming_step():
                estimate = self._sampler.estimate_sq(self._parameters_in_order, self.comm, self.step_count + 1)
            row["consensus"] = math.sqrt(estimate)
        self.metrics.record(row)
        self.step_count += 1
        self._mixing_done = False
        self._last_step_end = time.perf_counter()
        with self._naming_step():
            self._start()

    @contextlib.contextmanager
    def _naming_step(self) -> Iterator[None]:
        """Prefix a communication error with the training step (``step 7: rank 1: exchange 7 ...``).

        The error keeps its type and traceback; the communicator's own message says which exchange (sequence
        number) failed, which for PowerGossip with several iterations is not the step.
        """
        try:
            yield
        except GossipError as error:
            where = f"step {self.step_count}"
            if error.args and isinstance(error.args[0], str) and not error.args[0].startswith(f"{where}:"):
                error.args = (f"{where}: {error.args[0]}", *error.args[1:])
            raise

    def _start(self) -> None:
        # The algorithm state before start(t) is what a checkpoint taken during step t must hold (see checkpoint).
        self._state_before_start = copy.deepcopy(self.algorithm.state_dict())
        if math.isnan(self._last_step_end):
            self._last_step_end = time.perf_counter()
        self._pending = self.algorithm.start(self.step_count)
        self._started_at = time.perf_counter()

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        owned = self._ownership.get(optimizer)
        if owned is None:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            missing = [self._names[id(p)] for p in self._parameters_in_order if id(p) not in ids]
            owned = len(missing) < len(self._parameters_in_order)
            if owned and missing:
                raise ValueError(
                    f"rank {self.comm.rank}: the optimizer covers only part of the wrapped model; parameter "
                    f"'{missing[0]}' (and {len(missing) - 1} more) is missing: create it over model.parameters()"
                )
            self._ownership[optimizer] = owned
        return owned

    def _complete_pending(self) -> None:
        """Complete the in-flight exchange now and keep its result for the optimizer step, leaving x_t in place."""
        if self._pending is None:
            return
        local = [bucket.buffer.clone() for bucket in self.buckets]
        with self._naming_step():
            self.algorithm.finish(self._pending)
        self._mixed = [bucket.buffer.clone() for bucket in self.buckets]
        with torch.no_grad():
            for bucket, saved in zip(self.buckets, local, strict=True):
                bucket.buffer.copy_(saved)
        self._pending = None

    def _float_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, b) for name, b in self.module.named_buffers() if b.is_floating_point()]

    def _average_buffers(self) -> None:
        named = self._float_buffers()
        tensors = dict(named)
        with torch.no_grad():
            for flat in pack(named):
                self.comm.all_reduce(flat.buffer, "avg")
                for entry in flat.entries:
                    tensors[entry.name].copy_(flat.view(entry))

    # -- evaluation and consensus ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def averaged(self, buffers: bool = False) -> Iterator[nn.Module]:
        """Within the block the module holds the global average of the parameters (and of the floating-point
        buffers if ``buffers``); on exit every rank's own values come back bit for bit. A collective.

        An exchange in flight is completed first and its result kept for the optimizer step, so the training
        trajectory is the same as without the evaluation.
        """
        self._complete_pending()
        tensors = [bucket.buffer for bucket in self.buckets]
        if buffers:
            tensors += [b for _, b in self._float_buffers()]
        with averaged_replicas(tensors, self.comm):
            yield self.module

    def consensus_distance(self) -> float:
        """Exact consensus distance Xi = sqrt((1/n) sum_i ||x_i - xbar||^2) over the parameters. A collective."""
        return math.sqrt(exact_consensus_sq([bucket.buffer for bucket in self.buckets], self.comm))

    def estimate_consensus_distance(self, step: int | None = None) -> float:
        """Sampled (stratified, shared-coordinate) estimate of Xi; the coordinates depend on ``step``. A collective."""
        step = self.step_count if step is None else step
        return math.sqrt(self._sampler.estimate_sq(self._parameters_in_order, self.comm, step))

    # -- checkpoint support (used by gossip.checkpoint) -----------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        """The gossip state at step t: the step, x_t (the buckets) and the algorithm's state before start(t).

        Valid between ``optimizer.step()`` and the next step's update; an exchange in flight is not saved -- a
        run resumed from this state starts step t's exchange anew, which is bit-identical.
        """
        if self._mixing_done:
            raise RuntimeError(
                f"rank {self.comm.rank}: checkpoint inside step {self.step_count} (between the mixing and the "
                "optimizer's update); save after optimizer.step()"
            )
        in_flight = self._pending is not None or self._mixed is not None
        algorithm_state = self._state_before_start if in_flight else self.algorithm.state_dict()
        return {
            "step": self.step_count,
            "buckets": [bucket.buffer.detach().clone() for bucket in self.buckets],
            "algorithm": copy.deepcopy(algorithm_state),
        }

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`training_state`; an exchange in flight is completed (all ranks do it) and discarded."""
        if self._pending is not None:
            self.algorithm.finish(self._pending)
        self._pending, self._mixed, self._mixing_done = None, None, False
        with torch.no_grad():
            for bucket, saved in zip(self.buckets, state["buckets"], strict=True):
                bucket.buffer.copy_(saved)
        self.algorithm.load_state_dict(copy.deepcopy(state["algorithm"]))
        self.step_count = int(state["step"])
        self._last_step_end = math.nan

    # -- teardown -------------------------------------------------------------------------------------------
    def close(self) -> dict[str, float] | None:
        """Remove the hooks, complete an exchange in flight (parameters keep x_t) and summarise the metrics.

        A collective (the summary gathers one dict per rank); returns the summary on rank 0, None elsewhere.
        """
        _unsubscribe(self)
        self._complete_pending()
        self._mixed = None
        summary = self.metrics.summarize(self.comm)
        self.metrics.close()
        return summary
