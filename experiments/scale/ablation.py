"""Why the default's gap to DDP grows with n: arms that replace one part of the default pipeline by its exact version.

Each arm is the default pipeline (:class:`experiments.scale.config.EngineConfig`'s defaults, i.e.
:class:`gossip.Pipeline`) with its trackers mixed once a step and its second moment sampled every 64 steps
(``tracker_hops=1``, ``second_moment="sample"``: the base every arm is measured against) and one part changed, at a
fixed per-worker batch, paired with DDP on the same seed (the same initial model and tokens). The parts:

* the parameters' mixing: PowerGossip rank 4 x 2 in float16 -> exact gossip over the same schedule (``exact-params``)
  or PowerGossip at a higher rank (``pg-rank16``);
* the trackers: ChocoSign (scaled signs) -> exact trackers (``exact-trackers``);
* the second moment: the mean gradient sampled every 64 steps and gossiped -> the exact mean every step
  (``exact-v``);
* all three exact (``all-exact``): momentum tracking on the one-peer hypercube with nothing compressed; with it, the
  z^2 floor removed (``all-exact-uncapped``), every floor removed (``all-exact-shared-only``), and an oracle whose
  workers step on the exact mean first moment (``oracle-direction``: no tracker disagreement at all);
* the parameters and the trackers exact, the second moment still the gossiped sample (``exact-params-trackers``);
  the parameters and the second moment exact, the trackers still signs (``exact-params-v``); exact parameters
  with a sample every 16 steps (``exact-params-sm16``); PowerGossip at rank 16 with the exact second moment
  (``pg-rank16-exact-v``);
* a second moment that needs no sample: the tracked first moment squared plus each rank's gradient variance over n
  (:class:`LocalMomentMomentumTrackingAdamW`; ``local-moment``, and with exact mixing
  ``exact-params-trackers-local-moment``);
* u, the samples' average, kept over about seven samples instead of one (:class:`SampleMemoryMomentumTrackingAdamW`;
  ``mem4``, ``exact-params-mem4``, ``pg-rank16-mem4``) or over the last sample alone with the exact mean every step
  (``exact-params-v-last``), and the rank's own current second moment times the samples' ratio of the mean's
  square to the rank's own (:class:`RatioMomentumTrackingAdamW`, ``ratio4``);
* the trackers mixed twice a step, over W(2t) and W(2t + 1) (``tracker-2hops``), three times (``tracker-3hops``: the
  library's default ``tracker_hops`` from 9 to 16 workers) or four (``tracker-4hops``: its default from 17 to 64,
  every dimension of the 16-worker hypercube once a step); exact trackers over four hops, which at 16 workers hand
  every worker the exact mean first moment (``exact-trackers-4hops``), and with it the exact mean gradient's second
  moment every step (``exact-trackers-4hops-exact-v``); three hops with a sample every 16 steps
  (``tracker-3hops-sm16``); twice, with the sample of the mean
  gradient all-reduced instead of gossiped (``tracker-2hops-allreduce-v``: issue 59's
  comparison at the default's 16-worker setting), or gossiped in float32 instead of bfloat16
  (``tracker-2hops-float32-v``), or the exact mean handed over when the gossiped sample would be
  (:class:`DelayedMeanGradient`, ``tracker-2hops-delayed-v``: the gossip's delay without its rounding);
* the first sample of the mean gradient at three hops: gossiped in float32 (``tracker-3hops-float32-v``), handed
  over log2(n) steps late as the gossip does, exactly (``tracker-3hops-delayed-v``), or at once, later samples
  gossiped (:class:`FirstSampleNowMeanGradient`, ``tracker-3hops-first-now``: the all-reduced twin's first sample,
  then the default's); the steps before the first sample divided by the floor alone (the tracked first moment
  squared), not by the rank's own second moment (:class:`SignFirstMomentumTrackingAdamW`,
  ``tracker-3hops-sign-first``: Adam's first step, the sign of the first moment, needs no second moment);
* the second moment at one sequence a worker (n = 16 x 1), with exact trackers over four hops (every worker steps on
  the exact mean first moment, so the second moment alone differs from DDP) and with the default's three sign hops:
  u kept over about seven samples (``-mem4``), that u scaled by each tensor's drift since the samples
  (:class:`DriftMomentumTrackingAdamW`, ``-drift4``), the rank's own second moment times the samples' ratio
  (``-ratio4``), the floor the same on every rank (:class:`SharedFloorMomentumTrackingAdamW`: the ranks' exact mean
  of v-hat every step, ``-mean-floor``, or taken with the sample, ``-sampled-floor``), samples every 8 or 16 steps
  (``-sm8``, ``-sm16``) or all-reduced every 2 or 8 (``-ar2``, ``-ar8``), and the second moment read off the
  tracker every step, with the floor v_i / n (:class:`TrackedMomentumTrackingAdamW`, ``-tracked-v``) or without it
  (``-tracked-v-nofloor`` and ``tracker-v``: the library's ``second_moment="tracker"``); with the sample
  all-reduced at three hops (``tracker-3hops-allreduce-v``); the sample with Adam's current-gradient term read off
  the tracker (:class:`CurrentGradientMomentumTrackingAdamW`, ``-current``; with the exact mean every 2 steps,
  ``-ar2-current``); the smaller of the tracker's second moment and the sample (:class:`MinMomentumTrackingAdamW`,
  ``-min``);
* the warm-up: 100 steps, what the library resolves for runs of 1000 steps or more (``steps // 10`` capped at 100),
  instead of the arms' 30 (:data:`ARM_WARMUP`), for DDP, the default at 16 and at 64 workers and the all-reduced
  twin at 16 (``ddp-warmup100``, ``tracker-3hops-warmup100``, ``tracker-4hops-warmup100``,
  ``tracker-3hops-allreduce-v-warmup100``), and the sample's hops in float32 (``tracker-3hops-float32-v-warmup100``);
* step sizes: ChocoSign's consensus step size, beta1 (the trackers' increments are (1 - beta1)(g_i - h_i));
* the schedule (for the exact arms, which accept a directed one): one-peer exponential instead of the hypercube.

Run: ``python -m experiments.scale.ablation --workers 16 --steps 300`` (results to ``results/ablation/``, one
run at a time; a run already in its ``summary.csv`` is skipped). ``--stop-after S`` runs the first S steps of the
``--steps`` schedule (the warm-up and the cosine of the whole run): the early phase of a long run, at a fraction
of its cost.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import optim
from experiments.scale.config import EngineConfig
from experiments.scale.engine import Engine, MeanGradient
from experiments.scale.mixing import mean_in_rank_order
from experiments.scale.study import EVAL_BATCH, EVAL_BATCHES, RESULTS, done_runs
from experiments.shared import append_rows
from gossip.app.corpus import load_corpus, validation_batches

OUT = RESULTS / "ablation"
_ALL_EXACT = {"params": "exact", "trackers": "exact", "mean_gradient": "allreduce", "second_moment_every": 1}
#: exact trackers over four hops with the exact mean gradient every second step (``-ar2`` and ``-ar2-current``).
_EXACT_AR2 = {"trackers": "exact", "tracker_hops": 4, "mean_gradient": "allreduce", "second_moment_every": 2}
#: arm name -> the fields that differ from the default pipeline.
ARMS: dict[str, dict[str, object]] = {
    "ddp": {"params": "ddp", "trackers": "", "optimizer": "adamw"},
    "pipeline": {},
    "exact-params": {"params": "exact"},
    "pg-rank16": {"rank": 16},
    "exact-trackers": {"trackers": "exact"},
    "exact-v": {"mean_gradient": "allreduce", "second_moment_every": 1},
    "all-exact": _ALL_EXACT,
    "all-exact-exponential": {
        "params": "exact",
        "trackers": "exact",
        "mean_gradient": "allreduce",
        "second_moment_every": 1,
        "schedule": "one_peer_exponential",
    },
    "sm16": {"second_moment_every": 16},
    "sign-gamma0.5": {"sign_gamma": 0.5},
    "beta1-0.95": {"beta1": 0.95},
    "tracker-2hops": {"tracker_hops": 2},
    "tracker-3hops": {"tracker_hops": 3},
    "tracker-4hops": {"tracker_hops": 4},
    "exact-trackers-4hops": {"trackers": "exact", "tracker_hops": 4},
    "exact-trackers-4hops-exact-v": {
        "trackers": "exact",
        "tracker_hops": 4,
        "mean_gradient": "allreduce",
        "second_moment_every": 1,
    },
    "tracker-3hops-sm16": {"tracker_hops": 3, "second_moment_every": 16},
    "tracker-3hops-ratio4": {"tracker_hops": 3},
    "tracker-3hops-mem4": {"tracker_hops": 3},
    "exact-trackers-4hops-ratio4": {"trackers": "exact", "tracker_hops": 4},
    "exact-trackers-4hops-mean-floor": {"trackers": "exact", "tracker_hops": 4},
    "exact-trackers-4hops-sampled-floor": {"trackers": "exact", "tracker_hops": 4},
    "exact-trackers-4hops-mem4": {"trackers": "exact", "tracker_hops": 4},
    "exact-trackers-4hops-drift4": {"trackers": "exact", "tracker_hops": 4},
    "exact-trackers-4hops-sm8": {"trackers": "exact", "tracker_hops": 4, "second_moment_every": 8},
    "exact-trackers-4hops-sm16": {"trackers": "exact", "tracker_hops": 4, "second_moment_every": 16},
    "exact-trackers-4hops-ar8": {
        "trackers": "exact",
        "tracker_hops": 4,
        "mean_gradient": "allreduce",
        "second_moment_every": 8,
    },
    "exact-trackers-4hops-ar2": _EXACT_AR2,
    "exact-trackers-4hops-tracked-v": {"trackers": "exact", "tracker_hops": 4, "second_moment_every": 0},
    "tracker-3hops-tracked-v": {"tracker_hops": 3, "second_moment_every": 0},
    "exact-trackers-4hops-current": {"trackers": "exact", "tracker_hops": 4},
    "exact-trackers-4hops-ar2-current": _EXACT_AR2,
    "tracker-3hops-current": {"tracker_hops": 3},
    "exact-trackers-4hops-min": {"trackers": "exact", "tracker_hops": 4},
    "tracker-3hops-min": {"tracker_hops": 3},
    "tracker-4hops-tracked-v": {"tracker_hops": 4, "second_moment_every": 0},
    "tracker-3hops-tracked-v-nofloor": {"tracker_hops": 3, "second_moment": "tracker"},
    "tracker-v": {"second_moment": "tracker"},
    "tracker-4hops-tracked-v-nofloor": {"tracker_hops": 4, "second_moment": "tracker"},
    "tracker-3hops-mean-floor": {"tracker_hops": 3},
    "tracker-3hops-sampled-floor": {"tracker_hops": 3},
    "tracker-2hops-allreduce-v": {"tracker_hops": 2, "mean_gradient": "allreduce"},
    "tracker-3hops-allreduce-v": {"tracker_hops": 3, "mean_gradient": "allreduce"},
    "tracker-2hops-float32-v": {"tracker_hops": 2, "mean_gradient_dtype": ""},
    "tracker-2hops-delayed-v": {"tracker_hops": 2, "mean_gradient_dtype": ""},
    "tracker-3hops-delayed-v": {"tracker_hops": 3, "mean_gradient_dtype": ""},
    "tracker-3hops-float32-v": {"tracker_hops": 3, "mean_gradient_dtype": ""},
    "tracker-3hops-first-now": {"tracker_hops": 3},
    "tracker-3hops-sign-first": {"tracker_hops": 3},
    "cap4": {},
    "exact-params-cap4": {"params": "exact"},
    "all-exact-uncapped": _ALL_EXACT,
    "all-exact-shared-only": _ALL_EXACT,
    "oracle-direction": _ALL_EXACT,
    "exact-params-trackers": {"params": "exact", "trackers": "exact"},
    "exact-params-v": {"params": "exact", "mean_gradient": "allreduce", "second_moment_every": 1},
    "exact-params-sm16": {"params": "exact", "second_moment_every": 16},
    "pg-rank16-exact-v": {"rank": 16, "mean_gradient": "allreduce", "second_moment_every": 1},
    "local-moment": {"second_moment_every": 0},
    "exact-params-trackers-local-moment": {"params": "exact", "trackers": "exact", "second_moment_every": 0},
    "window-v": {},
    "exact-params-window-v": {"params": "exact"},
    "pg-rank16-window-v": {"rank": 16},
    "momentum-v": {},
    "pg-rank16-momentum-v": {"rank": 16},
    "momentum-v-w": {},
    "exact-params-momentum-v-w": {"params": "exact"},
    "pg-rank16-momentum-v-w": {"rank": 16},
    "exact-params-w": {"params": "exact"},
    "exact-params-window-v-ar64-w": {"params": "exact", "mean_gradient": "allreduce"},
    "exact-params-window-v-ar8-w": {"params": "exact", "mean_gradient": "allreduce", "second_moment_every": 8},
    "exact-params-window-v-w": {"params": "exact"},
    "window-v-w": {},
    "exact-params-v-last": {"params": "exact", "mean_gradient": "allreduce", "second_moment_every": 1},
    "exact-params-mem4": {"params": "exact"},
    "mem4": {},
    "pg-rank16-mem4": {"rank": 16},
    "ratio4": {},
}
#: the warm-up of every arm that names none (the ``-warmup100`` arms take the library's for 1000 steps and more).
ARM_WARMUP = 30
#: arms also run on the library's warm-up for runs of 1000 steps or more (``steps // 10`` capped at 100),
#: as ``{arm}-warmup100``.
WARMUP100_BASES = ("ddp", "tracker-3hops", "tracker-4hops", "tracker-3hops-allreduce-v", "tracker-3hops-float32-v")
ARMS |= {f"{base}-warmup100": {**ARMS[base], "warmup": 100} for base in WARMUP100_BASES}
#: arms that run :class:`CappedMomentumTrackingAdamW` with this cap (1e9: no z^2 floor).
CAPS = {"cap4": 4.0, "exact-params-cap4": 4.0, "all-exact-uncapped": 1e9}


def config(arm: str, workers: int, batch: int, steps: int) -> EngineConfig:
    """The arm's configuration, named ``n{n}-b{b}-s{steps}-{arm}`` (the DDP twin: arm ``ddp``), on
    :data:`ARM_WARMUP` warm-up steps unless the arm names its own.

    Args:
        arm: a key of :data:`ARMS`.
        workers: n.
        batch: sequences per worker.
        steps: steps (the lr schedule's length).

    Returns:
        The configuration.
    """
    fields = {"tracker_hops": 1, "second_moment": "sample", "warmup": ARM_WARMUP, **ARMS[arm]}
    return EngineConfig(name=f"n{workers}-b{batch}-s{steps}-{arm}", workers=workers, batch=batch, steps=steps,
                        **fields)  # fmt: skip


def _current_mean_gradient(state: dict, first: torch.Tensor, beta1: float) -> torch.Tensor:
    r""":math:`r_i = (z_i^t - \beta_1 z_i^{t-1}) / (1-\beta_1)` from the bias-corrected tracker ``first``: the current
    mean gradient where the trackers agree (the mean first moment's recursion inverted); keeps :math:`z_i^t` in
    ``state["last_tracker"]`` (a new tensor)."""
    tracker = first * (1 - beta1 ** state["step"])
    if "last_tracker" not in state:
        state["last_tracker"] = torch.zeros_like(tracker)
    current = (tracker - beta1 * state["last_tracker"]) / (1 - beta1)
    state["last_tracker"].copy_(tracker)
    return current


def _tracked_second_moment(state: dict, current: torch.Tensor, beta2: float) -> torch.Tensor:
    r""":math:`\hat u_i` after :math:`u_i \leftarrow \beta_2 u_i + (1-\beta_2) r_i^2` (``state["tracked"]``), a new
    tensor."""
    if "tracked" not in state:
        state["tracked"] = torch.zeros_like(current)
    state["tracked"].mul_(beta2).addcmul_(current, current, value=1 - beta2)
    return state["tracked"] / (1 - beta2 ** state["step"])


class _ArmOptimizer(optim.MomentumTrackingAdamW):
    """The library's update with another denominator (:meth:`denominator`): the experiment arms' optimizers,
    per-tensor loop only (the engine's CPU path)."""

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        """The square of the step's denominator for one parameter (a new tensor).

        Args:
            group: the parameter's group.
            state: its state.
            first: the bias-corrected first moment it steps on.

        Returns:
            What the step divides by, before the square root and eps.
        """
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        """The library's update with :meth:`denominator`.

        Args:
            closure: unsupported (None).
        """
        if not self._prepared:
            self.prepare_momentum()
        self._prepared = False
        for group, params, states, _ in self._with_gradients():
            beta1, lr = group["betas"][0], group["lr"]
            for p, state in zip(params, states, strict=True):
                first = p.grad / (1 - beta1 ** state["step"])
                denominator = self.denominator(group, state, first).sqrt_()
                p.mul_(1 - lr * group["weight_decay"])
                p.addcdiv_(first, denominator.add_(group["eps"]), value=-lr)


class CappedMomentumTrackingAdamW(_ArmOptimizer):
    r"""MomentumTrackingAdamW whose step may reach ``cap`` x lr per coordinate: the denominator is
    :math:`\sqrt{\max(\hat v, \hat z^2 / c^2)}` instead of :math:`\sqrt{\max(\hat v, \hat z^2)}` (c = 1 is the
    library's)."""

    def __init__(self, *args: object, cap: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.cap = float(cap)

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\hat v, \hat z^2 / c^2)` (class docstring)."""
        return torch.maximum(self.second_moment(group, state), first.square().div_(self.cap**2))


class SharedOnlyMomentumTrackingAdamW(_ArmOptimizer):
    r"""MomentumTrackingAdamW dividing by the mean gradient's second moment alone, :math:`\sqrt{\hat u}`: neither
    the floor :math:`v_i / n` nor :math:`\hat z^2` (each rank's own), so every rank divides by the same
    denominator."""

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\hat u`, or the rank's own :math:`\hat v_i` before the first sample (class docstring)."""
        beta2 = group["betas"][1]
        if state["samples"]:
            return state["shared"] / (1 - (beta2**self.second_moment_every) ** state["samples"])
        return state["v"] / (1 - beta2 ** state["step"])


class LocalMomentMomentumTrackingAdamW(_ArmOptimizer):
    r"""MomentumTrackingAdamW whose denominator needs no sample of the mean gradient: with :math:`\hat z` the
    tracked first moment (the mean gradient's, up to the trackers' disagreement) and :math:`\hat h_i, \hat v_i` the
    rank's own first and second moments,

    .. math::  \hat s_i = \hat z^2 + \max(\hat v_i - \hat h_i^2, 0) / n \approx E[\bar g]^2 + \sigma^2 / (n b),

    DDP's :math:`E[\bar g^2]`: the square of the mean plus each rank's gradient variance over n (the group's
    ``n``)."""

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\hat s_i` (class docstring)."""
        (beta1, beta2), step = group["betas"], state["step"]
        own = state["h"] / (1 - beta1**step)
        variance = (state["v"] / (1 - beta2**step)).sub_(own.square_()).clamp_min_(0)
        return variance.div_(group["n"]).addcmul_(first, first)


class WindowMomentumTrackingAdamW(_ArmOptimizer):
    r"""MomentumTrackingAdamW whose denominator splits DDP's :math:`E[\bar g^2] = (1 - 1/n)\,\mu^2 + E[g_i^2]/n`
    (independent ranks, :math:`\mu` the expected gradient): the rank's own :math:`\hat v_i / n` for the second
    term, and for :math:`\mu^2` the shared u of samples that are each the mean gradient averaged over the K steps
    since the previous sample (:class:`WindowMeanGradient`): :math:`\hat v = (1 - 1/n)\,\hat u + \hat v_i / n`."""

    weighted = False  # weight each sample by the steps it stands for: the first 1, the others K

    def take_mean_gradient(self, means: dict, workers: int) -> None:
        """u <- beta2^L u + (1 - beta2^L) mean^2, L = 1 for the first sample and K after it when :attr:`weighted`."""
        if not self.weighted:
            return super().take_mean_gradient(means, workers)
        for group in self.param_groups:
            group["workers"] = int(workers)
            for p in group["params"]:
                if p in means:
                    state = self._state(p)
                    steps = 1 if not state["samples"] else self.second_moment_every
                    rate = group["betas"][1] ** steps
                    state["shared"].mul_(rate).addcmul_(means[p], means[p], value=1 - rate)
                    state["samples"] += 1

    def shared(self, group: dict, state: dict) -> torch.Tensor:
        """u bias-corrected over the steps its samples stand for: 1 + K (s - 1) when :attr:`weighted`, else K s."""
        samples, every = state["samples"], self.second_moment_every
        covered = 1 + every * (samples - 1) if self.weighted else every * samples
        return state["shared"] / (1 - group["betas"][1] ** covered)

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\hat v, \hat z^2)` (class docstring)."""
        beta2, n = group["betas"][1], group["n"]
        local = state["v"] / (1 - beta2 ** state["step"])
        if state["samples"]:
            local = local.div_(n).add_(self.shared(group, state), alpha=1 - 1 / n)
        return torch.maximum(local, first.square())


class WeightedMomentumTrackingAdamW(WindowMomentumTrackingAdamW):
    r"""The library's denominator, :math:`\max(\hat u, \hat v_i / n, \hat z^2)`, with the samples weighted by the
    steps they stand for (:class:`WindowMomentumTrackingAdamW`'s ``weighted``)."""

    weighted = True

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\hat u, \hat v_i / n, \hat z^2)`."""
        beta2, n = group["betas"][1], group["n"]
        local = state["v"] / (1 - beta2 ** state["step"])
        if state["samples"]:
            local = torch.maximum(local.div_(n), self.shared(group, state))
        return torch.maximum(local, first.square())


class SampleMemoryMomentumTrackingAdamW(_ArmOptimizer):
    r"""The library's denominator, :math:`\max(\hat u, \hat v_i / n, \hat z^2)`, with u an exponential
    average over the samples at a rate of its own, :math:`u \leftarrow r\,u + (1 - r)\,\bar g^2` and
    :math:`\hat u = u / (1 - r^s)` after s samples, instead of its :math:`r = \beta_2^K`: r = 0 keeps the last
    sample alone, r = 3/4 averages about the last seven."""

    rate = 0.75

    def take_mean_gradient(self, means: dict, workers: int) -> None:
        """Advance each sampled parameter's averages (:meth:`advance`) and its sample count."""
        for group in self.param_groups:
            group["workers"] = int(workers)
            for p in group["params"]:
                if p in means:
                    state = self._state(p)
                    self.advance(group, state, means[p])
                    state["samples"] += 1

    def advance(self, group: dict, state: dict, mean: torch.Tensor) -> None:
        """u <- r u + (1 - r) mean^2."""
        state["shared"].mul_(self.rate).addcmul_(mean, mean, value=1 - self.rate)

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\hat u, \hat v_i / n, \hat z^2)` with this u."""
        beta2, n = group["betas"][1], group["n"]
        local = state["v"] / (1 - beta2 ** state["step"])
        if state["samples"]:
            shared = state["shared"] / (1 - self.rate ** state["samples"])
            local = torch.maximum(local.div_(n), shared)
        return torch.maximum(local, first.square())


class DriftMomentumTrackingAdamW(SampleMemoryMomentumTrackingAdamW):
    r""":class:`SampleMemoryMomentumTrackingAdamW`'s u, scaled by how far each tensor's second moment has moved since
    the samples: :math:`\hat u\,c` with :math:`c = \langle\hat v_i\rangle / \hat w`, where
    :math:`\langle\cdot\rangle` is the mean over the tensor's coordinates and w advances at the samples like u,
    :math:`w \leftarrow r\,w + (1 - r)\langle\hat v_i\rangle` (a scalar a tensor, so the same on every rank up
    to its batches' noise); the floors are the library's."""

    def advance(self, group: dict, state: dict, mean: torch.Tensor) -> None:
        """u and the scalar w advance."""
        super().advance(group, state, mean)
        beta2 = group["betas"][1]
        level = self._level(state, beta2)
        state["level"] = state.get("level", torch.zeros_like(level)).mul_(self.rate).add_(level, alpha=1 - self.rate)

    @staticmethod
    def _level(state: dict, beta2: float) -> torch.Tensor:
        """The rank's bias-corrected second moment's mean over the tensor's coordinates, one per row."""
        v = state["v"] / (1 - beta2 ** max(state["step"], 1))
        return v.flatten(1).mean(dim=1).view(-1, *([1] * (v.dim() - 1)))

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\hat u\,c, \hat v_i / n, \hat z^2)`."""
        beta2, n = group["betas"][1], group["n"]
        local = state["v"] / (1 - beta2 ** state["step"])
        if state["samples"]:
            correction = 1 - self.rate ** state["samples"]
            drift = self._level(state, beta2) / (state["level"] / correction).clamp_min(1e-30)
            shared = state["shared"] / correction * drift
            local = torch.maximum(local.div_(n), shared)
        return torch.maximum(local, first.square())


class RatioMomentumTrackingAdamW(SampleMemoryMomentumTrackingAdamW):
    r"""The second moment as the rank's own, fresh :math:`\hat v_i` times the ratio of the mean gradient's second
    moment to the rank's own, averaged over the samples: at each sample :math:`u \leftarrow r u + (1-r)\bar g^2`
    and :math:`w \leftarrow r w + (1-r)\hat v_i`, and :math:`\hat v = \mathrm{clamp}(u / w, 1/n, 1)\,\hat v_i`
    (the magnitudes' drift between samples cancels in the ratio); before the first sample, :math:`\hat v_i / n`."""

    def advance(self, group: dict, state: dict, mean: torch.Tensor) -> None:
        """u and w advance with the sample and the rank's own second moment now."""
        if "own" not in state:
            state["own"] = torch.zeros_like(mean)
        beta2, square = group["betas"][1], mean.square()
        own = state["v"] / (1 - beta2 ** state["step"]) if state["step"] else square
        state["shared"].mul_(self.rate).add_(square, alpha=1 - self.rate)
        state["own"].mul_(self.rate).add_(own, alpha=1 - self.rate)

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\mathrm{clamp}(u/w, 1/n, 1)\,\hat v_i, \hat z^2)`."""
        beta2, n = group["betas"][1], group["n"]
        local = state["v"] / (1 - beta2 ** state["step"])
        if state["samples"]:
            ratio = torch.nan_to_num(state["shared"] / state["own"], nan=1.0, posinf=1.0).clamp_(1 / n, 1.0)
            local = local.mul_(ratio)
        else:
            local = local.div_(n)
        return torch.maximum(local, first.square())


class CurrentGradientMomentumTrackingAdamW(_ArmOptimizer):
    r"""The library's sampled second moment with the current mean gradient's term of Adam's recursion added: the
    tracker gives :math:`r_i = (z_i^t - \beta_1 z_i^{t-1}) / (1-\beta_1)`, the current mean gradient where the
    trackers agree (as :class:`TrackedMomentumTrackingAdamW`), and the sample's :math:`\hat v` stands for Adam's
    :math:`\hat v_{t-1}`, so the step divides by
    :math:`\max\big((\beta_2 (1-\beta_2^{t-1}) \hat v + (1-\beta_2) r_i^2) / (1-\beta_2^t),\ \hat z_i^2\big)`:
    Adam's bound on the step a sudden gradient makes, without accumulating r_i's compression noise in u."""

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r"""The class docstring's maximum, keeping :math:`z_i^t` for the next step."""
        (beta1, beta2), step = group["betas"], state["step"]
        current = _current_mean_gradient(state, first, beta1)
        second = self.second_moment(group, state).mul_(beta2 * (1 - beta2 ** (step - 1)))
        second.addcmul_(current, current, value=1 - beta2).div_(1 - beta2**step)
        return torch.maximum(second, first.square())


class MinMomentumTrackingAdamW(_ArmOptimizer):
    r"""The smaller of two second moments, each too large in its own way: the tracker's
    :math:`\hat u_i` (as :class:`TrackedMomentumTrackingAdamW`: fresh, enlarged by the trackers' compression noise)
    and the library's sample :math:`\hat v` (clean, but as old as 64 steps while the gradients shrink), with Adam's
    current-step term as a floor: :math:`\max\big(\min(\hat u_i, \hat v),\ (1-\beta_2) r_i^2 / (1-\beta_2^t),\
    \hat z_i^2\big)`, :math:`r_i = (z_i^t - \beta_1 z_i^{t-1}) / (1-\beta_1)`."""

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r"""The class docstring's maximum, advancing :math:`u_i` and keeping :math:`z_i^t` first."""
        (beta1, beta2), step = group["betas"], state["step"]
        current = _current_mean_gradient(state, first, beta1)
        fresh = _tracked_second_moment(state, current, beta2)
        second = torch.minimum(fresh, self.second_moment(group, state))
        second = torch.maximum(second, current.square_().mul_((1 - beta2) / (1 - beta2**step)))
        return torch.maximum(second, first.square())


class SharedFloorMomentumTrackingAdamW(_ArmOptimizer):
    r"""The library's denominator with the floor the same on every rank: :math:`\max(\hat u, \bar v / n,
    \hat z^2)`, :math:`\bar v` the mean over the ranks of their bias-corrected :math:`\hat v_i` instead of each
    rank's own; with ``sampled``, that mean taken on the sample's due step and handed over with the sample (what
    the sample's hops would carry as a second vector), else the exact mean at every step (an oracle)."""

    sampled = False

    def prepare_momentum(self) -> None:
        """The library's phase 1, then (``sampled``) the ranks' mean of v-hat on the due steps."""
        due = self.sampled and self.mean_gradient_due()
        super().prepare_momentum()
        if not due:
            return
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                state = self._state(p)
                if state["step"]:
                    mean = (state["v"] / (1 - beta2 ** state["step"])).mean(dim=0, keepdim=True)
                    state["pending_floor"] = mean.expand_as(state["v"]).clone()

    def take_mean_gradient(self, means: dict, workers: int) -> None:
        """The library's sample, and the floor that travelled with it."""
        super().take_mean_gradient(means, workers)
        for p in means:
            state = self._state(p)
            if "pending_floor" in state:
                state["floor"] = state.pop("pending_floor")

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\hat u, \bar v / n, \hat z^2)` (class docstring); the library's before the first sample."""
        beta2 = group["betas"][1]
        if not state["samples"]:
            return torch.maximum(self.second_moment(group, state), first.square())
        shared = state["shared"] / (1 - (beta2**self.second_moment_every) ** state["samples"])
        if self.sampled:
            floor = state.get("floor", state["v"] / (1 - beta2 ** state["step"]))
        else:
            floor = (state["v"] / (1 - beta2 ** state["step"])).mean(dim=0, keepdim=True).expand_as(shared)
        return torch.maximum(torch.maximum(shared, floor / group["workers"]), first.square())


class TrackedMomentumTrackingAdamW(_ArmOptimizer):
    r"""The library's ``second_moment="tracker"`` with a sample's floor: the tracker :math:`z_i` estimates the mean
    first moment :math:`\bar m_t = \beta_1 \bar m_{t-1} + (1-\beta_1)\bar g_t`, so
    :math:`r_i = (z_i^t - \beta_1 z_i^{t-1}) / (1-\beta_1)` estimates :math:`\bar g_t` (exactly where the trackers
    are exact) and :math:`u_i \leftarrow \beta_2 u_i + (1-\beta_2)\, r_i^2` DDP's second moment; the
    denominator is :math:`\max(\hat u_i, \hat v_i / n, \hat z_i^2)`, the library's without the floor
    :math:`\hat v_i / n`."""

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        r""":math:`\max(\hat u_i, \hat v_i / n, \hat z_i^2)` (class docstring), advancing u_i first."""
        (beta1, beta2), n = group["betas"], group["n"]
        shared = _tracked_second_moment(state, _current_mean_gradient(state, first, beta1), beta2)
        local = state["v"] / (1 - beta2 ** state["step"])
        return torch.maximum(torch.maximum(shared, local.div_(n)), first.square())


class WindowMeanGradient(MeanGradient):
    """The gossiped sample of :class:`experiments.scale.engine.MeanGradient` taken of the mean of each row's
    gradients over the steps since the previous sample (this step's included) instead of this step's alone."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.window = torch.zeros_like(self.replicas.grad)
        self.count = 0

    def take(self, optimizer: optim.MomentumTrackingAdamW, step: int, plan: object) -> int:
        """Accumulate this step's gradients, then :meth:`MeanGradient.take` on the window's mean when due."""
        grad = self.replicas.grad
        self.window.add_(grad)
        self.count += 1
        if not optimizer.mean_gradient_due():
            return super().take(optimizer, step, plan)
        kept = grad.clone()
        grad.copy_(self.window).div_(self.count)
        sent = super().take(optimizer, step, plan)
        grad.copy_(kept)
        self.window.zero_()
        self.count = 0
        return sent


class MomentumMeanGradient(MeanGradient):
    """The gossiped sample of :class:`experiments.scale.engine.MeanGradient` taken of each row's bias-corrected
    first moment :math:`h_i / (1 - \beta_1^{t})` before this step's update (its gradient at step 0) instead of its
    gradient: an exponential window of past gradients."""

    def take(self, optimizer: optim.MomentumTrackingAdamW, step: int, plan: object) -> int:
        """:meth:`MeanGradient.take` with the first moments in place of the gradients on the due steps."""
        if not optimizer.mean_gradient_due() or step == 0:
            return super().take(optimizer, step, plan)
        kept = self.replicas.grad.clone()
        beta1 = optimizer.param_groups[0]["betas"][0]
        for name, p in self.replicas.views.items():
            state = optimizer.state[p]
            self.replicas.grad_views[name].copy_(state["h"]).div_(1 - beta1 ** state["step"])
        sent = super().take(optimizer, step, plan)
        self.replicas.grad.copy_(kept)
        return sent


class DelayedMeanGradient(MeanGradient):
    """The exact mean of the sampled gradients (all-reduced, in rank order) handed to the optimizer at the step the
    gossiped sample of :class:`experiments.scale.engine.MeanGradient` would be: the gossip's delay, not its
    rounding."""

    exact: torch.Tensor | None = None

    def take(self, optimizer: optim.MomentumTrackingAdamW, step: int, plan: object) -> int:
        """:meth:`MeanGradient.take`, keeping the exact mean of a sample when one is due."""
        if optimizer.mean_gradient_due():
            self.exact = mean_in_rank_order(self.replicas.grad)
        return super().take(optimizer, step, plan)

    def _hand_over(self, optimizer: optim.MomentumTrackingAdamW, means: torch.Tensor) -> None:
        super()._hand_over(optimizer, self.exact)


class FirstSampleNowMeanGradient(MeanGradient):
    """The first due sample's exact mean (all-reduced, in rank order) handed to the optimizer at once, as
    ``"allreduce"`` does; every later sample gossiped as the library's default. The first sample's bytes are counted
    as its gossip hops would send them where every rank sends at every hop (the hypercube): hops × n rows in the
    wire dtype."""

    first_taken = False

    def take(self, optimizer: optim.MomentumTrackingAdamW, step: int, plan: object) -> int:
        """:meth:`MeanGradient.take`, except that the first due sample is averaged and handed over in this step."""
        if self.first_taken or not optimizer.mean_gradient_due():
            return super().take(optimizer, step, plan)
        self.first_taken = True
        self._hand_over(optimizer, mean_in_rank_order(self.replicas.grad))
        grad, wire = self.replicas.grad, self.wire_dtype or self.replicas.grad.dtype
        return self.hops * self.schedule.n * grad.shape[1] * wire.itemsize


class SignFirstMomentumTrackingAdamW(_ArmOptimizer):
    r"""The library's update, but until the first sample of the mean gradient arrives the step divides by the floor
    :math:`\hat z_i^2` alone instead of :math:`\max(v_i / (1-\beta_2^t), \hat z_i^2)`: each coordinate moves by lr in
    the sign of the tracked first moment, which is DDP's AdamW first step (where :math:`\hat m = \bar g` and
    :math:`\hat v = \bar g^2`) up to the trackers' error; the rank's own second moment is n times too noisy."""

    def denominator(self, group: dict, state: dict, first: torch.Tensor) -> torch.Tensor:
        """The floor alone before the first sample, else the library's maximum."""
        if self.second_moment_every and not state["samples"]:
            return first.square()
        return torch.maximum(self.second_moment(group, state), first.square())


class OracleDirectionEngine(Engine):
    """An oracle, not an algorithm: every worker steps on the exact mean of the workers' first moments (what the
    trackers estimate), so that the workers differ only by the mixing of their parameters."""

    def _track(self, plans: list) -> None:
        grad = self.replicas.grad
        grad.copy_(grad.mean(dim=0, keepdim=True).expand_as(grad))


@torch.no_grad()
def diagnose(engine: Engine, sample: int = 1 << 20) -> dict[str, float]:
    r"""Where each worker's step stands against its denominator, after ``engine.step`` (``.grad`` holds z_i).

    For momentum tracking: with :math:`\hat z_i` the bias-corrected tracker and :math:`\hat v_i` the second moment
    that divides it (``MomentumTrackingAdamW.second_moment``), ``clipped`` is the fraction of coordinates where the
    floor :math:`\hat z_i^2 > \hat v_i` sets the step (a sign step of lr), ``noise_ratio`` the median over
    coordinates of :math:`|\hat z_i - \bar{\hat z}| / \sqrt{\hat v_i}` (the tracker's disagreement in units of
    the denominator), ``signal_ratio`` the median of :math:`|\bar{\hat z}| / \sqrt{\hat v_i}`, and
    ``floor_active`` the fraction where the floor :math:`v_i / n` exceeds the mean gradient's sample (0 for the
    second moment read off the tracker, which has no such floor).
    Quantiles over a random subsample of ``sample`` coordinates. Empty for other optimizers.

    Args:
        engine: the engine.
        sample: coordinates sampled for the medians.

    Returns:
        The four fractions / medians.
    """
    opt = engine.optimizer
    if not isinstance(opt, optim.MomentumTrackingAdamW):
        return {}
    firsts, seconds, floors = [], [], []
    for group, params, states, _ in opt._with_gradients():
        beta1, beta2 = group["betas"]
        for p, st in zip(params, states, strict=True):
            first = p.grad / (1 - beta1 ** st["step"])
            second = opt.second_moment(group, st)
            firsts.append(first.reshape(first.shape[0], -1))
            seconds.append(second.reshape(first.shape[0], -1))
            if "v" in st:  # the floor v_i / n of a sampled second moment
                local = st["v"] / (1 - beta2 ** st["step"]) / group["workers"]
                floors.append((local >= second).reshape(first.shape[0], -1))
            else:
                floors.append(torch.zeros_like(firsts[-1], dtype=torch.bool))
    first, second, floor = torch.cat(firsts, 1), torch.cat(seconds, 1), torch.cat(floors, 1)
    root = second.sqrt().clamp_min(1e-30)
    noise = ((first - first.mean(0)) / root).abs().flatten()
    signal = (first.mean(0).abs() / root).flatten()
    pick = torch.randint(noise.numel(), (min(sample, noise.numel()),), generator=torch.Generator().manual_seed(0))
    return {
        "clipped": float((first.square() > second).float().mean()),
        "noise_ratio": float(noise[pick].median()),
        "signal_ratio": float(signal[pick].median()),
        "floor_active": float(floor.float().mean()) if opt.second_moment_every or opt.tracks_second_moment else 1.0,
    }


def _swap_optimizer(engine: Engine, kind: type, **changes: object) -> optim.MomentumTrackingAdamW:
    """Replace the engine's optimizer by ``kind`` over the same param groups and the configuration's settings
    (``changes`` override them); every group learns n as ``group["n"]``. Returns the new optimizer."""
    config = engine.config
    settings = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": 1e-8}
    settings |= {"second_moment_every": config.second_moment_every, **changes}
    engine.optimizer = kind(engine.optimizer.param_groups, **settings)
    for group in engine.optimizer.param_groups:
        group["n"] = config.workers
    return engine.optimizer


def _swap_sampler(engine: Engine, kind: type[MeanGradient]) -> None:
    """Replace the engine's mean-gradient sampler by ``kind`` with the configuration's settings."""
    config = engine.config
    engine.mean_gradient = kind(config.mean_gradient, engine.schedule, engine.replicas, config.sample_dtype())


def arm_engine(config: EngineConfig, train: torch.Tensor, cap: float = 1.0) -> Engine:
    """The engine of an arm on the CPU: the library's parts, with the arm's optimizer or sampler swapped in.

    Args:
        config: the arm's configuration (:func:`config`; the arm is the part of its name after ``n-b-s``).
        train: the training bytes.
        cap: the step cap of :class:`CappedMomentumTrackingAdamW` (1: the library's optimizer).

    Returns:
        The engine, before its first step.
    """
    arm = config.name.split("-", 3)[-1]
    engine = (OracleDirectionEngine if arm == "oracle-direction" else Engine)(config, train, "cpu", "batched")
    if arm.endswith("local-moment"):
        _swap_optimizer(engine, LocalMomentMomentumTrackingAdamW, second_moment_every=0)
    if "window-v" in arm or "momentum-v" in arm:
        _swap_optimizer(engine, WindowMomentumTrackingAdamW).weighted = arm.endswith("-w")
        sampler = WindowMeanGradient if "window-v" in arm else MomentumMeanGradient
        _swap_sampler(engine, sampler)
    if arm.endswith("first-now"):
        _swap_sampler(engine, FirstSampleNowMeanGradient)
    if arm.endswith("sign-first"):
        _swap_optimizer(engine, SignFirstMomentumTrackingAdamW)
    if arm.endswith("delayed-v"):
        _swap_sampler(engine, DelayedMeanGradient)
    if arm == "exact-params-w":
        _swap_optimizer(engine, WeightedMomentumTrackingAdamW)
    if arm.endswith("tracked-v"):
        _swap_optimizer(engine, TrackedMomentumTrackingAdamW)
    if arm.endswith("-current"):
        _swap_optimizer(engine, CurrentGradientMomentumTrackingAdamW)
    if arm.endswith("-min"):
        _swap_optimizer(engine, MinMomentumTrackingAdamW)
    if arm.endswith("drift4"):
        _swap_optimizer(engine, DriftMomentumTrackingAdamW)
    if arm.endswith("ratio4"):
        _swap_optimizer(engine, RatioMomentumTrackingAdamW)
    if arm.endswith("-floor"):
        _swap_optimizer(engine, SharedFloorMomentumTrackingAdamW).sampled = arm.endswith("sampled-floor")
    if arm.endswith("mem4") or arm.endswith("v-last"):
        _swap_optimizer(engine, SampleMemoryMomentumTrackingAdamW).rate = 0.75 if arm.endswith("mem4") else 0.0
    if arm == "all-exact-shared-only":
        _swap_optimizer(engine, SharedOnlyMomentumTrackingAdamW)
    if cap != 1.0:
        _swap_optimizer(engine, CappedMomentumTrackingAdamW, cap=cap)
    return engine


def run(
    config: EngineConfig, seed: int, record_every: int, out: Path, cap: float = 1.0, stop_after: int | None = None
) -> dict:
    """:func:`experiments.scale.study.run` on the CPU with :func:`diagnose` in each record (``diagnostics.csv``).

    Args:
        config: the configuration (its ``seed`` is replaced).
        seed: the seed.
        record_every: steps between two records.
        out: the results folder (``steps.csv``, ``summary.csv``, ``diagnostics.csv``).
        cap: the step cap of :class:`CappedMomentumTrackingAdamW` (1: the library's optimizer).
        stop_after: the steps to run, from 1 to ``config.steps`` (None: all); the learning rate follows the
            schedule of ``config.steps``, and the summary row's ``step`` says where the run stopped.

    Returns:
        The summary row.

    Raises:
        FloatingPointError: the training loss is not finite.
    """
    config = config.replace(seed=seed)
    stop = config.steps if stop_after is None else stop_after
    if not 1 <= stop <= config.steps:
        raise ValueError(f"{config.name}: stop_after must be in [1, {config.steps}], got {stop}")
    corpus = load_corpus(None, block_size=config.block_size)
    held_out = validation_batches(corpus.validation, EVAL_BATCH, config.block_size, EVAL_BATCHES)
    engine = arm_engine(config, corpus.train, cap)
    started, losses, rows, diagnostics = time.perf_counter(), [], [], []
    for step in range(stop):
        losses.append(engine.step(step).mean())
        if (step + 1) % record_every == 0 or step + 1 == stop:
            block = float(torch.stack(losses).mean())
            if not math.isfinite(block):
                raise FloatingPointError(f"{config.name} seed {seed}: training loss {block} at step {step}")
            head = {"config": config.name, "seed": seed, "workers": config.workers, "batch": config.batch,
                    "schedule": engine.schedule.name, "step": step + 1}  # fmt: skip
            rows.append(
                {
                    **head,
                    "train_loss": block,
                    **engine.evaluate(held_out),
                    "bytes_per_worker": engine.bytes_per_worker(),
                    "seconds": time.perf_counter() - started,
                }
            )
            diagnostics.append({**head, **diagnose(engine)})
            losses = []
    append_rows(out / "steps.csv", rows)
    if len(diagnostics[-1]) > 6:
        append_rows(out / "diagnostics.csv", diagnostics)
    last = rows[-1]
    summary = {key: last[key] for key in ("config", "seed", "workers", "batch", "schedule", "step")}
    summary |= {
        "final_avg_val_loss": last["avg_val_loss"],
        "final_local_val_loss": last["local_val_loss"],
        "final_consensus": last["consensus"],
        "bytes_per_worker_per_step": last["bytes_per_worker"] / stop,
        "seconds_per_step": last["seconds"] / stop,
        "device": "cpu",
        "grad_mode": "batched",
    }
    append_rows(out / "summary.csv", [summary])
    return summary


def main(argv: list[str] | None = None) -> int:
    """The command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--record-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--stop-after", type=int, default=None, help="steps to run of the --steps schedule")
    args = parser.parse_args(argv)
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        parser.error(f"--stop-after must be in [1, --steps], got {args.stop_after} with --steps {args.steps}")
    torch.set_num_threads(1)
    done = done_runs(args.out / "summary.csv", args.stop_after or args.steps)
    for n in args.workers:
        for arm in args.arms:
            for seed in args.seeds:
                cfg = config(arm, n, args.batch, args.steps)
                if (cfg.name, seed) in done:
                    continue
                cap = float(CAPS.get(arm, 1.0))
                print(run(cfg, seed, args.record_every, args.out, cap, args.stop_after), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
