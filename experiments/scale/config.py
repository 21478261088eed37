"""One configuration of the scale engine, and the library objects it stands for.

:class:`EngineConfig` names a run the way the library builds it: the schedule (:func:`topologies.by_name`, by
default :func:`gossip.default_schedule`), the parameters' algorithm (DDP, :class:`gossip.ExactGossip` or
:class:`gossip.PowerGossip`), the trackers (none, exact, or :class:`gossip.ChocoSign`), the optimizer
(:class:`optim.AccumAdamW` with ``accum_iter=1``, i.e. AdamW, or :class:`optim.MomentumTrackingAdamW`) and the mean
gradient's averaging. Its defaults are the default pipeline (:class:`gossip.Pipeline`) on a GPT small enough that
n = 1024 replicas fit in one accelerator's memory. :meth:`EngineConfig.powergossip` and
:meth:`EngineConfig.tracking` return the unbound library objects; the engine runs their settings, the reference run
(:mod:`experiments.scale.reference`) hands them to :class:`gossip.DecentralizedDataParallel`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import gossip
import optim
import topologies
from gossip.app.gpt import GPTConfig
from gossip.app.train import default_warmup_steps

PARAMS = ("ddp", "exact", "powergossip")
TRACKERS = ("", "exact", "sign")
OPTIMIZERS = ("adamw", "momentum-tracking")


@dataclass(frozen=True)
class EngineConfig:
    """A run: the workers, the data, the model and the algorithms (defaults: the default pipeline).

    Attributes:
        name: the configuration's name in the results.
        workers: n, the number of replicas.
        batch: sequences per worker per step.
        steps: training steps (the lr schedule's length).
        lr: the peak learning rate (linear warm-up, then a cosine to lr / 10: ``gossip.app.train.learning_rate``).
        warmup: the learning rate's warm-up steps; None: the library's for ``steps``
            (:func:`gossip.app.train.default_warmup_steps`, what ``gossip-train`` resolves).
        seed: the model's and the batches' seed.
        n_layer: the GPT's blocks.
        n_embd: its width.
        n_head: its attention heads.
        block_size: tokens per sequence.
        params: how the parameters are mixed: ``"ddp"`` (gradients all-reduced), ``"exact"`` or ``"powergossip"``.
        rank: PowerGossip's rank.
        iterations: PowerGossip's power iterations per step.
        message_dtype: PowerGossip's message dtype, ``"float16"``, ``"bfloat16"`` or ``""`` (the parameters').
        gamma: the parameters' mixing step size.
        trackers: ``""`` (none), ``"exact"`` or ``"sign"`` (ChocoSign).
        sign_gamma: ChocoSign's consensus step size.
        sign_chunk: ChocoSign's values per scale.
        sign_levels: ChocoSign's magnitudes per chunk.
        tracker_hops: the trackers' exchanges a step, over W(kt), ..., W(kt + k - 1) (the wrapper's
            ``tracker_hops``); None: the default pipeline's for ``workers`` (:func:`gossip.default_tracker_hops`);
            1 without trackers.
        optimizer: ``"adamw"`` or ``"momentum-tracking"``.
        second_moment: MomentumTrackingAdamW's second moment, ``"tracker"`` or ``"sample"``.
        second_moment_every: with ``"sample"``, MomentumTrackingAdamW's steps between two samples of the mean
            gradient.
        mean_gradient: ``"gossip"`` or ``"allreduce"``.
        mean_gradient_dtype: the dtype the gossiped sample travels in, ``"bfloat16"``, ``"float16"`` or ``""`` (the
            gradients').
        schedule: a :func:`topologies.by_name` name; ``""`` is :func:`gossip.default_schedule`.
        beta1: Adam's beta1.
        beta2: Adam's beta2.
        weight_decay: decoupled weight decay on matrices.
    """

    name: str = "pipeline"
    workers: int = 16
    batch: int = 4
    steps: int = 1000
    lr: float = 3e-3
    warmup: int | None = None
    seed: int = 0
    n_layer: int = 2
    n_embd: int = 96
    n_head: int = 4
    block_size: int = 64
    params: str = "powergossip"
    rank: int = 4
    iterations: int = 2
    message_dtype: str = "float16"
    gamma: float = 1.0
    trackers: str = "sign"
    sign_gamma: float = 1.0
    sign_chunk: int = 256
    sign_levels: int = 4
    tracker_hops: int | None = None
    optimizer: str = "momentum-tracking"
    second_moment: str = "sample"
    second_moment_every: int = 64
    mean_gradient: str = "gossip"
    mean_gradient_dtype: str = "bfloat16"
    schedule: str = ""
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        if self.params not in PARAMS or self.trackers not in TRACKERS or self.optimizer not in OPTIMIZERS:
            raise ValueError(f"{self.name}: params in {PARAMS}, trackers in {TRACKERS}, optimizer in {OPTIMIZERS}")
        if self.params == "ddp" and (self.trackers or self.optimizer != "adamw"):
            raise ValueError(f"{self.name}: DDP runs AdamW on the all-reduced gradients, without trackers")
        if self.optimizer == "momentum-tracking" and not self.trackers:
            raise ValueError(f"{self.name}: momentum tracking needs trackers (the wrapper refuses it without)")
        if self.second_moment not in optim.SECOND_MOMENTS:
            raise ValueError(f"{self.name}: second_moment in {optim.SECOND_MOMENTS}, got {self.second_moment!r}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"{self.name}: warmup must be >= 0 steps or None (the library's), got {self.warmup}")
        if self.tracker_hops is not None and self.tracker_hops < 1:
            raise ValueError(f"{self.name}: tracker_hops must be >= 1, got {self.tracker_hops}")
        hops = gossip.default_tracker_hops(self.workers) if self.tracker_hops is None else self.tracker_hops
        object.__setattr__(self, "tracker_hops", hops if self.trackers else 1)  # no trackers, nothing to hop

    def gpt(self) -> GPTConfig:
        """The model's size.

        Returns:
            The :class:`GPTConfig`.
        """
        return GPTConfig(block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)

    def warmup_steps(self) -> int:
        """The warm-up the run follows.

        Returns:
            ``warmup``, at most half the run (so that a short run still reaches the peak), or the library's for
                ``steps`` when ``warmup`` is None.
        """
        return default_warmup_steps(self.steps) if self.warmup is None else min(self.warmup, self.steps // 2)

    def build_schedule(self) -> topologies.Schedule:
        """The schedule for n workers.

        Returns:
            ``schedule`` by name, or the default pipeline's for n.
        """
        return topologies.by_name(self.schedule or gossip.default_schedule(self.workers), self.workers)

    def powergossip(self) -> gossip.PowerGossip:
        """The parameters' PowerGossip, unbound.

        Returns:
            ``PowerGossip(rank, iterations, gamma, message_dtype=...)``.
        """
        dtype = getattr(torch, self.message_dtype) if self.message_dtype else None
        return gossip.PowerGossip(self.rank, self.iterations, self.gamma, message_dtype=dtype)

    def sampling_every(self) -> int:
        """MomentumTrackingAdamW's ``second_moment_every`` (:func:`optim.sampling_every`).

        Returns:
            ``second_moment_every`` with ``second_moment="sample"``, else 0.
        """
        return optim.sampling_every(self.second_moment, self.second_moment_every)

    def sample_dtype(self) -> torch.dtype | None:
        """The wrapper's ``mean_gradient_dtype``.

        Returns:
            The torch dtype, or None for the gradients' own.
        """
        return getattr(torch, self.mean_gradient_dtype) if self.mean_gradient_dtype else None

    def tracking(self) -> bool | str | gossip.ChocoSign:
        """The wrapper's ``gradient_tracking``.

        Returns:
            False, ``"exact"`` or a ChocoSign with this configuration's settings.
        """
        if self.trackers == "sign":
            return gossip.ChocoSign(self.sign_gamma, self.sign_chunk, self.sign_levels)
        return self.trackers or False

    def is_pipeline(self) -> bool:
        """Whether this is the default pipeline's combination (whose reference run uses :class:`gossip.Pipeline`).

        Returns:
            True for PowerGossip, sign trackers and momentum tracking at ChocoSign's defaults (any number of hops).
        """
        return (
            self.params == "powergossip"
            and self.trackers == "sign"
            and self.optimizer == "momentum-tracking"
            and (self.sign_gamma, self.sign_chunk, self.sign_levels) == (1.0, 256, 4)
            and self.gamma == 1.0
        )

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with ``changes``.

        Args:
            **changes: fields to change.

        Returns:
            The new configuration.
        """
        return dataclasses.replace(self, **changes)
