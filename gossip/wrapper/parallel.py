r"""``DecentralizedDataParallel``: the wrapper that puts gossip into an ordinary PyTorch training loop.

The order of one step (docs/design.md B.1 and G; Decent-DP's schema, arXiv 2410.11998):

.. math::  x_i^{t+1} = \sum_j W_{ij}(t)\, x_j^{t} \;-\; \eta\, d_i^{t}\big(g_i(x_i^{t})\big)

1. the exchange of :math:`x^t` with step t's peers starts right after step t-1's ``optimizer.step()`` (for t = 0
   at the first forward) -- ``algorithm.start(t)``;
2. forward and backward at :math:`x_i^t` run while it is in flight; the backward hooks let the algorithm progress
   on it without waiting (``algorithm.progress``: PowerGossip posts its further power iterations there once the
   previous exchange has arrived), and before a collective inside the step every rank posts what it could post early;
3. at ``optimizer.step()`` the wrapper first completes the exchange and writes the mixed parameters
   :math:`\sum_j W_{ij} x_j^t` -- ``algorithm.finish`` -- then the optimizer applies its update computed from
   :math:`g_i(x_i^t)`.

Steps 1 and 3 run from torch.optim's global step hooks (:mod:`gossip.wrapper.optimizer_hooks`, which calls
:meth:`DecentralizedDataParallel.before_optimizer_step` and :meth:`~DecentralizedDataParallel.after_optimizer_step`
for optimizers over this wrapper's parameters), so any ``torch.optim.Optimizer`` created after wrapping works
unchanged. Where the step stands between them is one :class:`gossip.wrapper.step_phase.StepPhase`
(IDLE -> EXCHANGING -> MIXED -> IDLE of the next step), whose legal moves :mod:`gossip.wrapper.step_phase` holds.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gossip.algorithms.base import Algorithm
from gossip.algorithms.buckets import DEFAULT_BUCKET_BYTES, bucket_parameters
from gossip.backends.base import Communicator
from gossip.errors import (
    ArgumentTypeError,
    AverageDriftWarning,
    CheckpointMismatchError,
    CommTimeoutError,
    GossipError,
    InvalidArgumentError,
    MixingOnlyStepWarning,
    ModelChangedError,
    StepPhaseError,
    UseAfterCloseError,
)
from gossip.wrapper import optimizer_hooks
from gossip.wrapper.buffer_average import average_buffers, float_buffers
from gossip.wrapper.consensus import (
    DEFAULT_SAMPLES,
    ConsensusSampler,
    exact_consensus_sq,
    global_average,
    reading,
)
from gossip.wrapper.mean_gradient import (
    MEAN_GRADIENT_SOURCES,
    GossipedMeanGradient,
    check_mean_gradient_dtype,
    make_mean_gradient,
)
from gossip.wrapper.metrics import StepMetrics
from gossip.wrapper.momentum import MomentumSource, momentum_source, optimizer_kind
from gossip.wrapper.peer_agreement import PeerAgreement
from gossip.wrapper.replicas import ReplicaMismatchError, broadcast_from_rank0, check_replicas
from gossip.wrapper.shard_layout import refuse_sharded
from gossip.wrapper.step_phase import StepPhase, StepState
from gossip.wrapper.tracking import (
    GradientTracker,
    check_tracker_hops,
    require_doubly_stochastic,
    tracker_mixing,
    tracking_setting,
)
from topologies import Schedule
from topologies.validation import find_violation

#: Errors whose message already names the step (or concerns no step): :meth:`_naming_step` leaves them as they are.
_NAMES_ITS_STEP = (ModelChangedError, ReplicaMismatchError, StepPhaseError)

BUFFER_POLICIES = ("local", "average")


def _forget_closed_wrappers_of(module: nn.Module) -> None:
    """A module wrapped again after ``close()``: its old, closed wrapper stops claiming its optimizers."""
    for listener in optimizer_hooks.listeners():
        if isinstance(listener, DecentralizedDataParallel) and listener.closed and listener.module is module:
            optimizer_hooks.unsubscribe(listener)


def _slot(module: nn.Module, name: str) -> tuple[dict[str, Any], str]:
    """The parameter dict of the submodule that owns parameter ``name`` (dotted, as ``named_parameters`` gives it),
    and its key there."""
    owner, _, key = name.rpartition(".")
    return module.get_submodule(owner)._parameters, key


def _same_entries(now: dict[str, Any], held: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the dict ``now`` holds the entries ``held``: the same keys in the same order, the same objects."""
    if len(now) != len(held):
        return False
    for (key, value), (held_key, held_value) in zip(now.items(), held, strict=True):
        if key != held_key or value is not held_value:
            return False
    return True


class _BackwardSeen:
    """Post-accumulate-grad hook: notes that a backward ran since the last optimizer step, and lets the algorithm
    make progress on the step's exchange (:meth:`gossip.Algorithm.progress`) while it wants to (holds a weak ref)."""

    def __init__(self, wrapper: DecentralizedDataParallel):
        self._wrapper = weakref.ref(wrapper)

    def __call__(self, parameter: torch.Tensor) -> None:
        wrapper = self._wrapper()
        if wrapper is not None:
            wrapper._backward_since_step = True
            if wrapper._progressing and wrapper._step.in_flight:
                wrapper._progress()


def _warn_if_average_drifts(schedule: Schedule, algorithm: Algorithm, rank: int) -> None:
    r"""Warn when the schedule's mixing matrices are row- but not column-stochastic.

    Gossip preserves the average :math:`\bar x = \frac1n \mathbf 1^\top x` only if
    :math:`\mathbf 1^\top W(t) = \mathbf 1^\top` (column sums 1); with row sums 1 alone the replicas still agree
    in the end, but on the weighted average :math:`\pi^\top x^0` given by the left Perron vector of W, biased
    towards the ranks that receive more weight.
    """
    if algorithm.name == "allreduce" or schedule.is_doubly_stochastic:
        return
    violation = find_violation(schedule, "column-stochastic")
    warnings.warn(
        f"rank {rank}: schedule '{schedule.name}' is row-stochastic but not doubly stochastic ({violation}); "
        "gossip will not preserve the average of the replicas, which drifts towards the ranks that receive more "
        "weight. Use a doubly stochastic schedule (e.g. weights='metropolis') unless that is intended",
        AverageDriftWarning,
        stacklevel=3,
    )


class DecentralizedDataParallel(nn.Module):
    """Gossip data parallelism around ``module``: each rank keeps its own replica and mixes it with its peers.

    Construction (a collective: every rank constructs its wrapper at the same point) checks that all ranks have
    the same parameter and buffer names, shapes, dtypes and device types, the same schedule (fingerprint) and
    algorithm config, and a schedule of ``comm.size`` ranks (else :class:`gossip.errors.ReplicaMismatchError`
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

    DDP-style accumulation code that wraps all but the last micro-batch in ``with model.no_sync():`` runs
    unchanged: gossip never communicates gradients, so the context changes nothing (see :meth:`no_sync`).

    A step whose update is skipped on some ranks only -- ``torch.amp.GradScaler`` finding an overflow, or any
    backward followed by ``optimizer.zero_grad()`` without ``optimizer.step()`` -- still mixes: the next forward
    (or ``close()``) notices gradients accumulated and then cleared, completes step t's mixing and advances, so
    the ranks stay in lockstep (the metrics row says ``update_skipped``). Clearing with
    ``zero_grad(set_to_none=False)`` leaves zero gradients that look like a real step's: that case is not detected.

    Without a torch optimizer, drive the step by hand: ``model.finish_mixing()`` before the update and
    ``model.next_step()`` after it (this is what the hooks call).

    Invariants, checked where they are cheap: the parameters stay the ones wrapped -- at every step one pass
    over ``named_parameters()`` (identities and storage addresses, no copy) raises
    :class:`gossip.errors.ModelChangedError` naming the parameter if one was rebound (``model.double()``,
    ``.to(...)``, ``load_state_dict(..., assign=True)``), replaced, added or removed, or changed
    ``requires_grad`` (convert, move, freeze and materialise lazy modules *before* wrapping). Frozen parameters
    are broadcast from rank 0 at construction, as DDP does, and never gossiped. A schedule whose matrices are not
    doubly stochastic draws an :class:`~gossip.errors.AverageDriftWarning`. Every use after ``close()`` is
    refused; inside ``averaged()`` the wrapper's own forward and optimizer steps are refused (evaluate with the
    module it yields).

    One optimizer must cover all of the wrapper's trainable parameters (a partial one is refused at its first
    ``step``); parameters added to it later with ``add_param_group`` are not seen. An optimizer subclass whose
    ``step`` calls ``super().step()`` is one step (the outermost call counts). If ``optimizer.step()`` raises, torch
    skips the post-hooks and this wrapper's step is left open: do not continue training with this wrapper.

    Args:
        module: the model to train; every rank passes the same architecture. Convert, move, freeze and
            materialise it before wrapping.
        comm: this rank's communicator (open); its ``size`` must equal the schedule's number of ranks.
        schedule: the mixing schedule W(t), the same on every rank.
        algorithm: how x_t is mixed (e.g. ``ExactGossip()``), configured the same on every rank; bound here to
            ``comm``, ``schedule`` and the buckets.
        bucket_bytes: the size of one flat parameter bucket in bytes (positive; equal on every rank).
        buffers: ``"local"`` (default) never mixes buffers (BatchNorm statistics stay per rank); ``"average"``
            all-reduces the floating-point buffers to their average at every step, blocking, right after the mixing
            (integer buffers such as ``num_batches_tracked`` stay local); the algorithm's ``nonfinite`` policy
            applies to them as to the parameters.
        run_dir: where this rank appends one JSON line of metrics per step (see :mod:`gossip.wrapper.metrics`), or
            None. When any rank has one the consensus sampling runs on every rank, so passing it on rank 0 only is
            fine.
        consensus_every: sample the consensus distance every this many steps (one small all-reduce of
            ``2 * consensus_samples`` float64 values); 0 turns it off.
        consensus_samples: how many coordinates the consensus estimate samples.
        seed: the seed of the sampled coordinates. ``consensus_every``, ``consensus_samples``, ``seed``,
            ``bucket_bytes``, ``buffers``, ``gradient_tracking`` and the algorithm's ``nonfinite`` policy must be
            equal on every rank.
        gradient_tracking: the optimizer steps on a tracker y_i of the mean gradient instead of this rank's own
            gradient (:mod:`gossip.wrapper.tracking`: y_i <- sum_j W_ij(t) (y_j + g_j^t - g_j^{t-1}), so that
            sum_i y_i = sum_i g_i^t at every step; NEXT, DIGing, Pu & Nedić 2020). At ``optimizer.step()``, after the
            parameters' mixing, the trackers are exchanged over W(t) -- one more exchange of model size per step,
            *blocking* in this version (it needs the fresh gradient) -- and y_i is written into the parameters'
            ``.grad`` before the update. Needs a doubly stochastic schedule; call ``optimizer.zero_grad()`` every
            step (a backward without it would accumulate onto y_i). The trackers are part of the checkpoint.
            ``True`` or ``"exact"`` mixes the trackers exactly; ``"powergossip"`` (``PowerGossip()``) or an
            algorithm object (e.g. ``gossip.PowerGossip(rank=4)``) mixes them compressed, whose antisymmetric
            per-edge corrections keep sum_i y_i = sum_i g_i^t on a symmetric schedule.
        tracking_overlap: with gradient tracking, the combine-then-adapt tracker (DIGing's form,
            y_i <- sum_j W_ij(t) y_j^{t-1} + g_i^t - g_i^{t-1}): the trackers' exchange starts with the parameters'
            and runs during forward and backward instead of blocking the optimizer step; the same sum invariant.
        tracker_hops: with gradient tracking, the trackers' exchanges a step (adapt-then-combine only): k mixes the
            trackers over W(kt), ..., W(kt + k - 1) after the step's gradients are added
            (:mod:`gossip.wrapper.tracking`, "Several hops a step"), at k times the trackers' bytes; the
            parameters keep W(t). Equal on every rank.
        mean_gradient: with gradient tracking, how a momentum-tracking optimizer's sample of the mean gradient is
            formed (:mod:`gossip.wrapper.mean_gradient`): ``"gossip"`` (default) averages it over the schedule's own
            steps, one hop a step beside the parameters' exchange, exact after the schedule's finite-time window
            (log2 n steps of the hypercube), and hands it over then; ``"allreduce"`` all-reduces the gradients at the
            step it is due (a collective over every rank). Equal on every rank.
        mean_gradient_dtype: the dtype the gossiped sample's hops travel in (``torch.bfloat16``, the default, or
            ``torch.float16``, ``torch.float32``; None: the gradients'). Each rank rounds its own sample to it before
            a hop and sums in the gradients' dtype, so the ends of an edge still agree bit for bit
            (:mod:`gossip.wrapper.mean_gradient`, "Message precision"). Equal on every rank.

    Raises:
        ArgumentTypeError: ``module`` already contains a wrapper.
        UseAfterCloseError: ``comm`` is closed.
        InvalidArgumentError: ``buffers``, ``bucket_bytes`` or ``consensus_every`` has a value it cannot take, or
            ``gradient_tracking`` is asked for with a schedule that is not doubly stochastic, or is not one of the
            accepted values.
        ReplicaMismatchError: the ranks disagree on the model, the schedule, the algorithm or a setting above.
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
        gradient_tracking: bool | str | Algorithm = False,
        tracking_overlap: bool = False,
        tracker_hops: int = 1,
        mean_gradient: str = "gossip",
        mean_gradient_dtype: torch.dtype | None = torch.bfloat16,
    ):
        super().__init__()
        if any(isinstance(inner, DecentralizedDataParallel) for inner in module.modules()):
            raise ArgumentTypeError(
                f"rank {comm.rank}: the module already contains a DecentralizedDataParallel; wrap the plain model "
                "once (a wrapper inside a wrapper would mix the parameters twice per step)"
            )
        if comm.closed:
            raise UseAfterCloseError(
                f"rank {comm.rank}: the communicator was already closed (comm.close()); create a new one with "
                "gossip.init() before wrapping"
            )
        if not self._shards_replicas:
            refuse_sharded(module, comm.rank)
        if buffers not in BUFFER_POLICIES:
            raise InvalidArgumentError(f"rank {comm.rank}: buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        if bucket_bytes <= 0:
            raise InvalidArgumentError(f"rank {comm.rank}: bucket_bytes must be positive, got {bucket_bytes}")
        if mean_gradient not in MEAN_GRADIENT_SOURCES:
            raise InvalidArgumentError(
                f"rank {comm.rank}: mean_gradient must be one of {MEAN_GRADIENT_SOURCES}, got {mean_gradient!r}"
            )
        check_mean_gradient_dtype(f"rank {comm.rank}", mean_gradient_dtype)
        if consensus_every < 0:
            raise InvalidArgumentError(
                f"rank {comm.rank}: consensus_every must be >= 0 (0 = off), got {consensus_every}"
            )
        check_tracker_hops(tracker_hops, f"rank {comm.rank}", tracking_overlap)
        if tracker_hops > 1 and not gradient_tracking:
            raise InvalidArgumentError(
                f"rank {comm.rank}: tracker_hops={tracker_hops} mixes the trackers several times a step, but "
                "gradient_tracking is off; turn gradient tracking on or drop tracker_hops"
            )
        self.module = module
        self.comm, self.schedule, self.algorithm = comm, schedule, algorithm
        self.buffers_policy = buffers
        settings = {
            "bucket_bytes": int(bucket_bytes),
            "buffers": buffers,
            "consensus_every": int(consensus_every),
            "consensus_samples": int(consensus_samples),
            "seed": int(seed),
            # the algorithm's non-finite policy (one rank dropping what another raises on would split the run)
            "nonfinite": algorithm.nonfinite,
            "gradient_tracking": tracking_setting(gradient_tracking),
            "tracking_overlap": bool(tracking_overlap),
            "tracker_hops": tracker_hops,
            "mean_gradient": mean_gradient,
            "mean_gradient_dtype": str(mean_gradient_dtype),
        }
        self.signature = self._check_run(module, comm, schedule, algorithm, settings)
        if gradient_tracking:
            require_doubly_stochastic(schedule, comm.rank)  # before the parameters move into buckets
        mixing = tracker_mixing(gradient_tracking) if gradient_tracking else None
        if tracking_overlap and not gradient_tracking:
            raise InvalidArgumentError(
                f"rank {comm.rank}: tracking_overlap=True overlaps the trackers' exchange, but gradient_tracking is "
                "off; turn gradient tracking on or drop tracking_overlap"
            )
        self.buckets = self._make_buckets(module, bucket_bytes)
        algorithm.setup(comm, schedule, self.buckets)  # refuses a bad schedule or configuration on every rank
        self._broadcast_initial()
        _warn_if_average_drifts(schedule, algorithm, comm.rank)
        # Every parameter as wrapped: (name, object, storage address, requires_grad), checked at every step.
        self._bound = [(name, p, self._address(p), p.requires_grad) for name, p in module.named_parameters()]
        # The same as (owning module's parameter dict, key, object, address, requires_grad), and every module with
        # the entries of its parameter and child dicts: the checks of every step read these directly instead of
        # walking the module tree (see _check_bound_parameters).
        self._bound_slots = [(*_slot(module, name), p, address, requires_grad)
                             for name, p, address, requires_grad in self._bound]  # fmt: skip
        self._bound_tree = [(m, tuple(m._parameters.items()), tuple(m._modules.items()))
                            for m in module.modules()]  # fmt: skip
        self._step = StepState()  # the phase of step t: the only place its legal moves are decided
        self._averaging = False  # inside averaged()
        self._backward_since_step = False  # a backward accumulated gradients since the last optimizer step
        self._forward_since_step = False  # the wrapper's forward ran since the last optimizer step
        self._progressing = False  # the algorithm may make progress on the exchange in flight (backward hooks)
        # the optimizer and W(t), compared with each step's peers (gossip.wrapper.peer_agreement)
        self._agreement = PeerAgreement(comm, schedule, algorithm.traffic)

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._parameters_in_order = [p for _, p in named]
        # The same tensors as views of the buckets (the bucket entries follow the parameters' order): what the
        # replica holds even while averaged() lets the parameters read the average.
        self._replica_views = self._replica_tensors()
        self._names = {id(p): name for name, p in named}
        #: The gradient tracker (gradient_tracking=True), else None; its exchange runs in finish_mixing.
        self.tracker: GradientTracker | None = None
        if gradient_tracking:
            self.tracker = GradientTracker(
                algorithm,
                schedule,
                self.buckets,
                self._parameters_in_order,
                mixing,
                overlap=tracking_overlap,
                option=gradient_tracking,
                hops=tracker_hops,
            )
        #: how a momentum-tracking optimizer's sample of the mean gradient is formed (gossip.wrapper.mean_gradient)
        self._mean_gradient = (
            make_mean_gradient(
                mean_gradient, algorithm, schedule, self.buckets, self._parameters_in_order, mean_gradient_dtype
            )
            if gradient_tracking
            else None
        )
        self._ownership: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._optimizer_agreed = False  # the ranks compared their optimizers' kinds (gossip.wrapper.momentum)
        self._momentum_prepared_at = -1  # the step whose first moment the optimizer last prepared
        self._sampled_at = -1  # the step whose sample of the mean gradient was last attempted
        self._tracked_at = -1  # the step whose mixing (parameters, first moment, trackers) is complete
        self._finish_began = 0.0  # when the step's finish began (its timing)
        self.step_count = 0
        self._exchange: Any = None  # what algorithm.start(t) returned, while the step is EXCHANGING
        self._state_before_start: dict[str, Any] | None = None  # see _start

        self.metrics = StepMetrics(run_dir, comm.rank)
        # Sampled on every rank as soon as one rank has a run_dir: logging on rank 0 only must not leave rank 0
        # alone in the consensus all-reduce (and without any run_dir nothing would read it).
        anyone_logs = any(self.comm.all_gather_object(run_dir is not None))
        self.consensus_every = consensus_every if anyone_logs else 0
        self._sampler = ConsensusSampler([t.numel() for t in self._replica_views], consensus_samples, seed)
        self._started_at = self._last_step_end = math.nan
        self._timing = {"compute_seconds": 0.0, "wait_seconds": math.nan, "finish_seconds": 0.0}
        for parameter in self._parameters_in_order:
            parameter.register_post_accumulate_grad_hook(_BackwardSeen(self))

        _forget_closed_wrappers_of(module)
        optimizer_hooks.subscribe(self)

    #: whether this wrapper mixes the local shards of sharded replicas (:mod:`gossip.wrapper.sharded`)
    _shards_replicas = False

    # -- what the sharded wrapper (gossip.wrapper.sharded) replaces ----------------------------------------------
    def _check_run(
        self, module: nn.Module, comm: Communicator, schedule: Schedule, algorithm: Algorithm, settings: dict
    ) -> dict:
        """The construction's agreement of every rank on the run (:func:`gossip.wrapper.replicas.check_replicas`)."""
        return check_replicas(module, comm, schedule, algorithm, settings)

    def _make_buckets(self, module: nn.Module, bucket_bytes: int) -> list:
        """The buckets the algorithm mixes: the parameters moved into flat buckets (they become views)."""
        return bucket_parameters(module, bucket_bytes)

    def _broadcast_initial(self) -> None:
        """Rank 0's parameters, frozen parameters and buffers copied to every rank, before the first step."""
        broadcast_from_rank0(self.module, self.buckets, self.comm)

    def _address(self, parameter: torch.Tensor) -> int:
        """Where ``parameter``'s values live, compared at every step (a rebound parameter moved)."""
        return parameter.data_ptr()

    def _replica_tensors(self) -> list[torch.Tensor]:
        """What this replica holds, one tensor per trainable parameter (views of the buckets), also while
        ``averaged()`` lets the parameters read the average: what the consensus distances read."""
        return [bucket.view(entry) for bucket in self.buckets for entry in bucket.entries]

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: the wrapper no longer mixes and refuses every further use."""
        return self._step.closed

    @property
    def phase(self) -> StepPhase:
        """Where the current step is (:class:`gossip.wrapper.step_phase.StepPhase`)."""
        return self._step.phase

    def _move(self, event: str, operation: str, *, check_only: bool = False) -> None:
        """Apply a step event (see :data:`gossip.wrapper.step_phase.TRANSITIONS`); raise StepPhaseError if illegal.

        ``check_only``: only refuse an illegal event, before an action that cannot be undone.
        """
        where = f"rank {self.comm.rank}: step {self.step_count}: {operation}"
        if check_only:
            self._step.check(event, where)
            return
        self._step.move(event, where)
        if event == "discard":  # the step starts over: none of its parts is done
            self._momentum_prepared_at = self._tracked_at = -1

    # -- the loop -------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; the first forward of step t starts x_t's exchange.

        Args:
            *args: positional arguments of the module's forward.
            **kwargs: keyword arguments of the module's forward.

        Returns:
            What the module returns.

        Raises:
            StepPhaseError: called inside ``averaged()``.
            UseAfterCloseError: called after ``close()``.
        """
        self._require_usable("forward")
        if self._averaging:
            raise StepPhaseError(
                f"rank {self.comm.rank}: step {self.step_count}: the wrapper's forward was called inside "
                "averaged(); it would start an exchange of the averaged values. Evaluate with the module that "
                "averaged() yields: `with model.averaged() as net: net(x)`"
            )
        if self._backward_since_step and all(p.grad is None for p in self._parameters_in_order):
            self._skipped_step()
        self._forward_since_step = True
        self.metrics.flush()
        if self.phase is StepPhase.IDLE:
            self._start()
        return self.module(*args, **kwargs)

    def _progress(self) -> None:
        """From a backward hook: let the algorithm progress on step t's exchange (it never waits), until it says
        there is nothing more to do before the optimizer step."""
        with torch.no_grad(), self._naming_step():
            self._progressing = self.algorithm.progress(self._exchange)

    def _settle_exchange(self) -> None:
        """Before a collective inside step t after its backward (``averaged()``, the consensus distances, a
        checkpoint's agreement): post every exchange of step t that the backward hooks may have posted early on
        some ranks only (:meth:`gossip.Algorithm.progress` with ``wait``), so that every rank's communicator runs
        the same operations in the same order. Nothing to do before the step's backward (no rank progressed)."""
        if self._step.in_flight and self._backward_since_step:
            with torch.no_grad(), self._naming_step():
                self.algorithm.progress(self._exchange, wait=True)
            self._progressing = False

    def _skipped_step(self) -> None:
        """A backward ran, then the gradients were cleared without an optimizer step (e.g. ``GradScaler`` found
        an overflow on this rank only): the update is skipped, but step t's mixing still runs, so this rank
        stays in lockstep with its peers (mixing does not depend on the local update)."""
        self.finish_mixing()
        self.next_step(update_skipped=True)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """DDP's gradient-accumulation context, accepted so that DDP code runs unchanged; it changes nothing here.

        DDP all-reduces gradients in every backward, and ``no_sync()`` defers that to the last micro-batch.
        Gossip never communicates gradients: the parameters are mixed once per ``optimizer.step()``, so
        micro-batches accumulate locally with or without this context, and the result is the same.

        Returns:
            A context manager that does nothing.

        Raises:
            UseAfterCloseError: called after ``close()``.
        """
        self._require_usable("no_sync")
        return contextlib.nullcontext()

    def log(self, **values: Any) -> None:
        """Add ``values`` to this step's metrics row.

        Call it before ``optimizer.step()``, or after it and before the next forward (see
        :meth:`gossip.wrapper.metrics.StepMetrics.note`).

        Args:
            **values: the row's entries, e.g. ``loss=loss``.
        """
        self.metrics.note(**values)

    def finish_mixing(self) -> None:
        """Complete step t's exchange and write the mixed parameters (called before the optimizer's update).

        Idempotent within a step. When no exchange is in flight (no forward this step) it runs one blocking.

        Raises:
            StepPhaseError: called inside ``averaged()``.
            UseAfterCloseError: called after ``close()``.
        """
        self._mix_before_update(None)

    def _mix_before_update(self, momentum: MomentumSource | None) -> None:
        """:meth:`finish_mixing`, with ``momentum``, the stepping optimizer if it is a momentum source, whose first
        moment then goes through the tracker (:func:`gossip.wrapper.momentum.prepare_momentum`)."""
        self._require_usable("optimizer step (mixing)")
        if self._averaging:
            raise StepPhaseError(
                f"rank {self.comm.rank}: step {self.step_count}: optimizer.step() (or finish_mixing) inside "
                "averaged(); the averaged values would be trained and then overwritten on exit. Step after the block"
            )
        if self._step.mixed and self._tracked_at == self.step_count:
            return
        with self._naming_step():
            if not self._step.mixed:
                self._check_bound_parameters()
                self._finish_mixing()
            self._finish_tracking(momentum)

    def _finish_mixing(self) -> None:
        """The parameters' part of the step's mixing: x_i <- sum_j W_ij x_j, then the phase is MIXED."""
        self.metrics.flush()
        if self.phase is StepPhase.IDLE:
            self._start()
        self._timing["compute_seconds"] = time.perf_counter() - self._started_at
        self._finish_began = time.perf_counter()
        self.algorithm.finish(self._exchange)
        self._exchange = None
        self._agreement.check(self.step_count)
        self._move("finish", "finish_mixing()")

    def _finish_tracking(self, momentum: MomentumSource | None) -> None:
        """The rest of the step's mixing, after the parameters': ``momentum``'s first moment, then the trackers.

        Each part runs once per step. An elastic run whose member set changes inside it (a wait interrupted)
        calls it again on the new group's communicator: a part already done is not repeated, the parameters'
        mixing (already written) is not repeated either (:func:`gossip.wrapper.elastic.rebind` keeps the phase),
        and the sample of the mean gradient is attempted once: one that the change interrupted or refused is
        skipped, never posted again on another group (where the members that did not post it would not join it).
        """
        if momentum is not None and self._momentum_prepared_at != self.step_count:
            sample, self._sampled_at = self._sampled_at != self.step_count, self.step_count  # attempted once a step
            # a momentum source without trackers is refused before
            assert self._mean_gradient is not None and self.tracker is not None
            with torch.no_grad():
                self.tracker.fill_missing_gradients()  # a parameter this step did not reach: a zero gradient
                self._mean_gradient.take(momentum, self.step_count, sample)
            momentum.prepare_momentum()
            self._momentum_prepared_at = self.step_count
        if self.tracker is not None:
            self.tracker.track(self.step_count)
        self._tracked_at = self.step_count
        self._timing["wait_seconds"] = self.algorithm.wait_seconds
        self._timing["finish_seconds"] = time.perf_counter() - self._finish_began
        if self.buffers_policy == "average":
            average_buffers(self.module, self.comm, self.algorithm.nonfinite, self.step_count)

    def next_step(self, **values: Any) -> None:
        """End step t after the update: record its metrics, advance to t + 1 and start x_{t+1}'s exchange.

        Args:
            **values: more entries of step t's metrics row.

        Raises:
            StepPhaseError: step t's mixing is not finished (:meth:`finish_mixing` first).
            UseAfterCloseError: called after ``close()``.
        """
        self._require_usable("next_step")
        self._move("advance", "next_step()", check_only=True)  # refused before anything is recorded
        self._backward_since_step = self._forward_since_step = False
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
                estimate = self._sampler.estimate_sq(self._replica_views, self.comm, self.step_count + 1)
            row["consensus"] = math.sqrt(estimate)
        self.metrics.record(row)
        self._move("advance", "next_step()")
        self.step_count += 1
        self._last_step_end = time.perf_counter()
        with self._naming_step():
            self._start()

    @contextlib.contextmanager
    def _naming_step(self) -> Iterator[None]:
        """Prefix a communication error with the training step (``step 7: rank 1: exchange 7 ...``).

        The error keeps its type and traceback; the communicator's own message says which exchange (sequence
        number) failed, which for PowerGossip with several iterations is not the step. The wrapper's own errors
        (:data:`_NAMES_ITS_STEP`) already name the step and pass unchanged.
        """
        try:
            yield
        except _NAMES_ITS_STEP:
            raise
        except GossipError as error:
            where = f"step {self.step_count}"
            if error.args and isinstance(error.args[0], str) and not error.args[0].startswith(f"{where}:"):
                error.args = (f"{where}: {error.args[0]}", *error.args[1:])
            raise

    def _warn_if_mixing_only(self) -> None:
        """An optimizer step with neither a forward nor a backward since the previous one only mixes. Deliberate
        on every rank it is harmless; on one rank only (``optimizer.step()`` called twice) it puts that rank one
        step ahead, which nothing can tell from a deliberate one until ``close()`` (where the crossed exchange
        raises :class:`ExchangeMismatchError` on both of its ends): say so now."""
        if self.closed or self._averaging or self._forward_since_step or self._backward_since_step:
            return
        warnings.warn(
            f"rank {self.comm.rank}: step {self.step_count}: optimizer.step() with no forward or backward since the "
            "previous step only mixes; unless every rank does the same, this rank is now one step ahead of its peers "
            "and close() will fail",
            MixingOnlyStepWarning,
            stacklevel=5,  # this, before_optimizer_step, the registry's hook, torch's step wrapper, the caller
        )

    def _require_usable(self, operation: str) -> None:
        if self.closed:
            raise UseAfterCloseError(
                f"rank {self.comm.rank}: {operation} after close() (step {self.step_count}); this wrapper no longer "
                "mixes: wrap the module again (with an open communicator) to keep training"
            )
        if self.comm.closed:
            raise UseAfterCloseError(
                f"rank {self.comm.rank}: {operation} at step {self.step_count}: the communicator was closed "
                "(comm.close()) while the wrapper still uses it; close the wrapper first, the communicator last"
            )

    def _check_parameters(self) -> None:
        """Raise :class:`ModelChangedError` unless the module's parameters are still the ones wrapped.

        A trainable parameter must still be a view of its bucket (``model.double()``, ``.to(...)``,
        ``load_state_dict(..., assign=True)`` rebind it, and the bucket would then be mixed while the optimizer
        trains a copy); no parameter may be added, removed or replaced, or change ``requires_grad``. One pass over
        ``named_parameters()`` comparing object identities and storage addresses: no copy, no synchronisation.
        """
        where = f"rank {self.comm.rank}: step {self.step_count}"
        current = list(self.module.named_parameters())
        for (name, parameter), (bound_name, bound, address, requires_grad) in zip(current, self._bound, strict=False):
            if name != bound_name:
                raise ModelChangedError(
                    f"{where}: found parameter '{name}' where '{bound_name}' was wrapped: a parameter was added, "
                    "removed or renamed after wrapping and would not be mixed. Create every parameter before "
                    "wrapping (run one forward first for lazy modules such as nn.LazyLinear)"
                )
            if parameter is not bound:
                raise ModelChangedError(
                    f"{where}: parameter '{name}' was replaced by another Parameter after wrapping (e.g. "
                    "load_state_dict(..., assign=True)); the new one would not be mixed. Load or replace before "
                    "wrapping, or load with the default assign=False"
                )
            if parameter.requires_grad != requires_grad:
                raise ModelChangedError(
                    f"{where}: parameter '{name}' changed requires_grad from {requires_grad} to "
                    f"{parameter.requires_grad} after wrapping; the wrapper gossips the parameters trainable when "
                    "it was built: freeze or unfreeze before wrapping (and the same on every rank)"
                )
            if requires_grad and self._address(parameter) != address:
                raise ModelChangedError(
                    f"{where}: parameter '{name}' no longer lives in the wrapper's bucket: it was rebound after "
                    "wrapping (model.double(), .to(dtype or device), load_state_dict(..., assign=True), "
                    "param.data = ...), so the mixing would miss it. Convert or move the model before wrapping"
                )
        if len(current) != len(self._bound):
            name = current[len(self._bound)][0] if len(current) > len(self._bound) else self._bound[len(current)][0]
            change = "registered" if len(current) > len(self._bound) else "removed"
            raise ModelChangedError(
                f"{where}: parameter '{name}' was {change} after wrapping; it would not be mixed. Create every "
                "parameter before wrapping (run one forward first for lazy modules such as nn.LazyLinear)"
            )

    def _check_bound_parameters(self) -> None:
        """What :meth:`_check_parameters` checks, read from the dicts ``named_parameters()`` is built from: every
        module of the wrapped tree still holds the same entries in its parameter and child dicts (the same keys, in
        the same order, the same objects), so the walk would name the same parameters in the same order; and every
        parameter is still in its bucket, with the same ``requires_grad``. Any change found runs the full check,
        which names it. No walk of the module tree: one pass over each module's two dicts."""
        for module, parameters, children in self._bound_tree:
            if not (_same_entries(module._parameters, parameters) and _same_entries(module._modules, children)):
                self._check_parameters()
                return
        for _, _, bound, address, requires_grad in self._bound_slots:
            if bound.requires_grad != requires_grad or (requires_grad and self._address(bound) != address):
                self._check_parameters()
                return

    def _start(self) -> None:
        self._check_bound_parameters()
        # The algorithm state before start(t) is what a checkpoint taken during step t must hold (see checkpoint);
        # an algorithm whose start changes no state (start_keeps_state) is read when the checkpoint asks instead.
        if not self.algorithm.start_keeps_state:
            self._state_before_start = self.algorithm.state_snapshot()
        if math.isnan(self._last_step_end):
            self._last_step_end = time.perf_counter()
        self._move("start", "starting the exchange", check_only=True)
        self._exchange = self.algorithm.start(self.step_count)
        self._progressing = True
        if self.tracker is not None:
            self.tracker.start(self.step_count)  # overlapped tracking only: y^{t-1}'s exchange joins x_t's
        self._agreement.post(self.step_count)
        if self._mean_gradient is not None:
            self._mean_gradient.post(self.step_count)  # a hop of the mean gradient's sample in progress
        self._move("start", "starting the exchange")
        self._started_at = time.perf_counter()

    # -- the optimizer-step hooks (gossip.wrapper.optimizer_hooks calls these) ---------------------------------
    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` trains this wrapper's parameters.

        Args:
            optimizer: an optimizer about to step.

        Returns:
            True when it covers the wrapper's trainable parameters, False when it covers none of them.

        Raises:
            InvalidArgumentError: it covers only part of them.
        """
        owned = self._ownership.get(optimizer)
        if owned is None:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            missing = [self._names[id(p)] for p in self._parameters_in_order if id(p) not in ids]
            owned = len(missing) < len(self._parameters_in_order)
            if owned and missing:
                raise InvalidArgumentError(
                    f"rank {self.comm.rank}: the optimizer covers only part of the wrapped model; parameter "
                    f"'{missing[0]}' (and {len(missing) - 1} more) is missing: create it over model.parameters()"
                )
            self._ownership[optimizer] = owned
        return owned

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, computes_gradients: bool) -> None:
        """Before the update: complete step t's mixing (warn first if the step had no forward or backward).

        Args:
            optimizer: the optimizer that steps (one this wrapper :meth:`owns`).
            computes_gradients: whether its ``step`` computes gradients itself (a closure), so no backward is due.
        """
        if not computes_gradients:
            self._warn_if_mixing_only()
        source = momentum_source(optimizer)
        if source is not None or self.tracker is not None:
            self._check_optimizer(optimizer, source, computes_gradients)
        self._mix_before_update(source)

    def _check_optimizer(
        self, optimizer: torch.optim.Optimizer, source: MomentumSource | None, computes_gradients: bool
    ) -> None:
        """With gradient tracking or a momentum source: the ranks agree on the optimizer (once), and a momentum
        source's step runs its first moment through the tracker (see :mod:`gossip.wrapper.momentum`). A momentum
        source without a tracker is refused on its own rank, before any collective: a rank with an ordinary
        optimizer beside it would never join the agreement."""
        where = f"rank {self.comm.rank}: step {self.step_count}"
        if source is not None and self.tracker is None:
            raise InvalidArgumentError(
                f"{where}: {type(optimizer).__name__} runs its first moment through the gradient trackers, but this "
                "DecentralizedDataParallel has gradient tracking off; pass gradient_tracking=True (or "
                "'powergossip') to it, or use an optimizer that steps on .grad (e.g. torch.optim.AdamW)"
            )
        if not self._optimizer_agreed:  # compared with the peers of the next steps (gossip.wrapper.peer_agreement)
            self._agreement.compare_optimizer(optimizer_kind(optimizer), self.step_count)
            self._optimizer_agreed = True
        if source is None:
            return
        if computes_gradients:
            raise InvalidArgumentError(
                f"{where}: {type(optimizer).__name__}.step(closure): the wrapper prepares the first moment before "
                "the step runs, so the closure's gradients would come too late; run the backward, then call "
                "optimizer.step() without a closure"
            )
        if self._tracked_at == self.step_count and self._momentum_prepared_at != self.step_count:
            raise StepPhaseError(
                f"{where}: finish_mixing() ran before {type(optimizer).__name__}.step(), so the tracker mixed the "
                "gradient, not the first moment; with a momentum-tracking optimizer let optimizer.step() finish "
                "the mixing (drop the explicit finish_mixing() call)"
            )

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the update: end step t and start x_{t+1}'s exchange.

        Args:
            optimizer: the optimizer that stepped.
        """
        self.next_step(lr=optimizer.param_groups[0].get("lr"))

    def _drain_exchange(self) -> None:
        """For ``close()``: complete an exchange in flight (every rank does, so none is left waiting) and drop its
        result, so that the parameters keep x_t."""
        with self._naming_step():
            self._drain_side_exchanges()
        if not self._step.in_flight:
            with self._naming_step():
                self.algorithm.drain()
            return
        local = [bucket.buffer.clone() for bucket in self.buckets]
        with self._naming_step():
            self.algorithm.finish(self._exchange)
            self.algorithm.drain()
        self._exchange = None
        with torch.no_grad():
            for bucket, saved in zip(self.buckets, local, strict=True):
                bucket.buffer.copy_(saved)

    def _drain_side_exchanges(self) -> None:
        """Complete and drop what travels beside the parameters: the trackers' overlapped exchange, the peers'
        comparison and a hop of the mean gradient's sample."""
        if self.tracker is not None:
            self.tracker.drain()
        self._agreement.drain()
        if self._mean_gradient is not None:
            self._mean_gradient.drain()

    # -- evaluation and consensus ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def averaged(self, buffers: bool = False) -> Iterator[nn.Module]:
        """Let the module hold the global average of the parameters within the block. A collective.

        With ``buffers`` the floating-point buffers are averaged too; on exit every rank's own values are back,
        untouched. The average is computed into one new buffer per bucket (a clone of x_t, then ``all_reduce``) and the
        module's parameters are pointed at it for the block (:func:`gossip.wrapper.consensus.reading`); the buckets are
        only read. So an exchange in flight, which sends the buckets' memory, keeps running undisturbed and is
        completed by the optimizer step as usual: the training trajectory is the same as without the evaluation,
        and the only full-model copy is the average itself.

        Args:
            buffers: average the floating-point buffers as well.

        Yields:
            The module, holding the average.

        Raises:
            UseAfterCloseError: called after ``close()``.
        """
        self._require_usable("averaged()")
        self._settle_exchange()  # a collective while step t's exchange may be in flight
        average = global_average([bucket.buffer for bucket in self.buckets], self.comm)
        parameters = dict(self.module.named_parameters())
        targets = [parameters[entry.name] for bucket in self.buckets for entry in bucket.entries]
        values = [bucket.view(entry, mean) for bucket, mean in zip(self.buckets, average, strict=True)
                  for entry in bucket.entries]  # fmt: skip
        if buffers:
            floats = [b for _, b in float_buffers(self.module)]
            targets += floats
            values += global_average(floats, self.comm)
        self._averaging = True
        try:
            with reading(targets, values):
                yield self.module
        finally:
            self._averaging = False

    def consensus_distance(self) -> float:
        """Exact consensus distance Xi = sqrt((1/n) sum_i ||x_i - xbar||^2) over the parameters. A collective.

        Of the replicas themselves, also inside ``averaged()`` (where the module reads the average).

        Returns:
            Xi, the same on every rank.

        Raises:
            UseAfterCloseError: called after ``close()``.
        """
        self._require_usable("consensus_distance()")
        self._settle_exchange()
        return math.sqrt(exact_consensus_sq([bucket.buffer for bucket in self.buckets], self.comm))

    def estimate_consensus_distance(self, step: int | None = None) -> float:
        """Sampled (stratified, shared-coordinate) estimate of Xi. A collective.

        Args:
            step: the step that picks the sampled coordinates (default: the current step).

        Returns:
            The estimate of Xi, the same on every rank.

        Raises:
            UseAfterCloseError: called after ``close()``.
        """
        self._require_usable("estimate_consensus_distance()")
        self._settle_exchange()
        step = self.step_count if step is None else step
        return math.sqrt(self._sampler.estimate_sq(self._replica_views, self.comm, step))

    # -- checkpoint support (used by gossip.checkpoint) -----------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        """The gossip state at step t: the step, x_t (the buckets) and the algorithm's state before start(t).

        Valid between ``optimizer.step()`` and the next step's update; an exchange in flight is not saved -- a
        run resumed from this state starts step t's exchange anew, which is bit-identical. With gradient tracking
        the trackers y_i^{t-1} and the gradients g_i^{t-1} are saved too (under ``"tracker"``), and the mean
        gradient's sample in progress (under ``"mean_gradient"``, with ``mean_gradient="gossip"``).

        Returns:
            ``{"step": t, "buckets": [copies of the buckets], "algorithm": the algorithm's state}``, plus
                ``"tracker"`` with gradient tracking, ``"mean_gradient"`` with its gossiped sample, and
                ``"algorithm_in_flight"`` when the algorithm keeps an exchange in flight across steps.

        Raises:
            StepPhaseError: called between the mixing and the optimizer's update.
        """
        if self._step.mixed:
            raise StepPhaseError(
                f"rank {self.comm.rank}: checkpoint inside step {self.step_count} (between the mixing and the "
                "optimizer's update); save after optimizer.step()"
            )
        in_flight = self._step.in_flight and not self.algorithm.start_keeps_state
        algorithm_state = self._state_before_start if in_flight else self.algorithm.state_dict()
        state = {
            "step": self.step_count,
            "buckets": [bucket.buffer.detach().clone() for bucket in self.buckets],
            "algorithm": copy.deepcopy(algorithm_state),
        }
        if self.tracker is not None:
            state["tracker"] = self.tracker.state_dict()
        if isinstance(self._mean_gradient, GossipedMeanGradient):
            state["mean_gradient"] = self._mean_gradient.state_dict()
        in_flight = self.algorithm.in_flight_state()  # an exchange kept across steps (waited for, not applied)
        if in_flight:
            state["algorithm_in_flight"] = in_flight
        return state

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`training_state`; an exchange in flight is completed (all ranks do it) and discarded.

        Args:
            state: what :meth:`training_state` returned, on this rank of a run of the same model and settings.

        Raises:
            CheckpointMismatchError: the state was saved with gradient tracking and this run has none, or the
                other way round.
        """
        if ("tracker" in state) != (self.tracker is not None):
            saved, here = ("with", "without") if "tracker" in state else ("without", "with")
            raise CheckpointMismatchError(
                f"rank {self.comm.rank}: the state was saved {saved} gradient tracking, but this run is {here} it; "
                "resume with the same gradient_tracking setting"
            )
        if self._step.in_flight:
            self.algorithm.finish(self._exchange)
            self._exchange = None
        self.algorithm.drain()  # an exchange kept across steps: completed and dropped (the state is replaced)
        self._move("discard", "load_training_state()")
        with torch.no_grad():
            for bucket, saved in zip(self.buckets, state["buckets"], strict=True):
                bucket.buffer.copy_(saved)
        self.algorithm.load_state_dict(copy.deepcopy(state["algorithm"]))
        self.algorithm.load_in_flight_state(state.get("algorithm_in_flight", {}))
        if self.tracker is not None:
            self.tracker.load_state_dict(state["tracker"])
        self._agreement.drain()
        if isinstance(self._mean_gradient, GossipedMeanGradient) and "mean_gradient" in state:
            self._mean_gradient.load_state_dict(state["mean_gradient"])
        self.step_count = int(state["step"])
        self._last_step_end = math.nan

    # -- teardown -------------------------------------------------------------------------------------------
    def _closing_handshake(self) -> None:
        """Announce ``close()`` to the peers of the exchange that would come next (W(t + 1)'s edges).

        A peer one step ahead (an extra ``optimizer.step()`` on that rank) is inside that very exchange: the
        announcement and its message cross, and both ends raise :class:`ExchangeMismatchError` naming the
        other's exchange and step count (see :meth:`gossip.backends.base.Communicator.closing_handshake`).
        """
        view = self.schedule.peers(self.comm.rank, self.step_count + 1)
        with self._naming_step():
            self.comm.closing_handshake(
                [peer for peer, _ in view.out_peers], [peer for peer, _ in view.in_peers], self.step_count
            )

    def close(self) -> dict[str, float] | None:
        """Complete an exchange in flight (parameters keep x_t), summarise the metrics and retire the wrapper.

        A collective (the summary gathers one dict per rank). A step whose update was skipped just before (a backward,
        no ``optimizer.step()``) still mixes first, as during training. Afterwards every forward, optimizer step over
        these parameters, ``averaged()`` or consensus call raises :class:`~gossip.errors.UseAfterCloseError`; a second
        ``close()`` does nothing.

        Returns:
            The run's summary on rank 0, None on the other ranks (and on a second call).

        Raises:
            CommTimeoutError: a peer never started the last exchange (it took fewer steps than this rank).
        """
        if self.closed:
            return None
        self._require_usable("close()")
        if self._backward_since_step and not self._step.mixed:
            self._skipped_step()
        try:
            self._drain_exchange()
            self._closing_handshake()
        except CommTimeoutError as error:
            error.args = (
                f"{error.args[0]} -- in close() after {self.step_count} optimizer steps on this rank: a peer that "
                "took fewer steps never starts this exchange (did this rank call optimizer.step() without a "
                "forward, or a peer clear its gradients with zero_grad(set_to_none=False) and skip its step?)",
                *error.args[1:],
            )
            raise
        self._move("close", "close()")
        summary = self.metrics.summarize(self.comm)
        self.metrics.close()
        # Non-finite values received in the last step, where the check runs one step late (CUDA parameters);
        # after the collective above, so that a raising rank leaves no peer waiting in it.
        self.algorithm.check_deferred()
        return summary
