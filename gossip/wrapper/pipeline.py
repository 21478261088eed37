r"""The default pipeline in one call: pure gossip that learns like DDP, no collective in the training step.

``model, optimizer = gossip.wrap(net, comm, lr=3e-3)`` builds the library's default (:class:`Pipeline`):

* the schedule: the one-peer hypercube when n is a power of two, else the one-peer Base-2 graph
  (:func:`topologies.base_graph`): one peer per step, the exact average after one period, for any n
  (:func:`default_schedule`);
* the parameters: :class:`gossip.PowerGossip` at rank 4 with 2 power iterations per step, its products in float16
  (Vogels et al. 2020);
* the trackers: the wrapper's gradient tracking mixes each rank's first moment (momentum tracking, Takezawa et al.,
  TMLR 2023) by :class:`gossip.ChocoSign`, CHOCO-Gossip with scaled-sign messages of 3 bits a value; above 8 ranks
  k = ceil(log2(n) / 2) + 1 times a step, over the schedule's W(kt), ..., W(kt + k - 1) (``tracker_hops``,
  :func:`default_tracker_hops`, :mod:`gossip.wrapper.tracking`);
* the optimizer: :class:`optim.MomentumTrackingAdamW`, dividing by the mean gradient's second moment sampled every
  64 steps and averaged by gossip over the schedule, its hops in bfloat16 (``second_moment="sample"``,
  ``mean_gradient="gossip"``, :mod:`gossip.wrapper.mean_gradient`), with decoupled weight decay on matrices only
  (:func:`optim.param_groups`). ``second_moment="tracker"`` reads it off each rank's tracker every step instead,
  with no message of its own (the tracker's mean is the mean first moment, whose EMA recursion gives back the mean
  gradient; ``optim/momentum_tracking.py``).

Each step then sends point-to-point messages to the schedule's peers only: W(t)'s for the parameters' products, the
trackers' signs (W(kt)'s to W(kt + k - 1)'s with k hops) and, every 64 steps, the log2(n) hops of one gradient
sample (none with ``second_moment="tracker"``); and over the first steps the peers' comparison of settings
(:mod:`gossip.wrapper.peer_agreement`). Why
these choices, and what they reach against DDP and DiLoCo: docs/results.md. Any part can be changed
(``Pipeline(rank=8).wrap(...)``), and the parts stay available to assemble by hand (README, "Use it in your own
loop").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

import optim
import topologies
from gossip.algorithms.choco_sign import ChocoSign
from gossip.algorithms.powergossip import PowerGossip
from gossip.backends.base import Communicator
from gossip.errors import InvalidArgumentError
from gossip.wrapper.mean_gradient import MEAN_GRADIENT_SOURCES, check_mean_gradient_dtype
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.tracking import TRACKER_MIXINGS, check_tracker_hops

#: Ranks up to which the default pipeline mixes its trackers once a step (:func:`default_tracker_hops`).
ONE_HOP_UP_TO = 8


def default_tracker_hops(n: int) -> int:
    r"""The default pipeline's tracker exchanges a step for n ranks: 1 up to 8, else ceil(log2(n) / 2) + 1.

    Above :data:`ONE_HOP_UP_TO` ranks, :math:`k = \lceil \log_2(n) / 2 \rceil + 1`, the fewest hops with
    :math:`2^k \ge 2 \sqrt{n}` (:math:`4^{k-1} \ge n`).
    A rank's tracked first moment differs from the mean by about its own last increments, :math:`(1 - \beta_1)
    (g_i - h_i)`, mostly its own gradient noise σ, while the mean gradient the optimizer divides by,
    :math:`\sqrt{\mu^2 + \sigma^2 / n}`, shrinks with n: with one hop the trackers' relative disagreement grows
    like :math:`\sqrt{n}`. k hops over the next k matrices of the one-peer hypercube average each increment evenly
    over :math:`2^k` ranks before the optimizer reads it (:mod:`gossip.wrapper.tracking`), dividing that
    disagreement by :math:`\sqrt{2^k}`: it grows like :math:`\sqrt{n / 2^k}`. Holding it constant would take
    :math:`\log_2 n - c` hops, nearly the exact average's; the default takes one more than half of them,
    :math:`2^k \ge 2\sqrt{n}`, so that it stays below :math:`n^{1/4} / \sqrt{2}`. Each hop is one more message of
    the trackers a step, sent after the backward, which is why up to :data:`ONE_HOP_UP_TO` ranks, where one hop
    already learns like DDP, the default stays at one (docs/results.md, "The default pipeline").

    Args:
        n: the number of ranks, >= 1.

    Returns:
        1 for n <= :data:`ONE_HOP_UP_TO`; 3 for n <= 16, 4 for n <= 64, 5 for n <= 256, 6 for n <= 1024, ...
    """
    if n <= ONE_HOP_UP_TO:
        return 1
    hops = 2
    while 4 ** (hops - 1) < n:
        hops += 1
    return hops


def default_schedule(n: int) -> str:
    """The default schedule's name for n ranks.

    Args:
        n: the number of ranks, >= 1.

    Returns:
        ``"one_peer_hypercube"`` when n is a power of two >= 2, else ``"base_graph"`` (its one-peer version, equal
            to the hypercube at powers of two; one rank: its single step W = [1]).
    """
    return "one_peer_hypercube" if n >= 2 and n & (n - 1) == 0 else "base_graph"


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The settings of the default pipeline (module docstring); each field is one choice, with its default.

    Attributes:
        rank: PowerGossip's rank for the parameters.
        power_iterations: PowerGossip's power iterations (exchanges) per step.
        message_dtype: the dtype PowerGossip's products travel in (None: the parameters').
        trackers: how the trackers are mixed: ``"sign"`` (:class:`gossip.ChocoSign`), ``"exact"`` or
            ``"powergossip"`` (the wrapper's ``gradient_tracking``).
        tracker_hops: the trackers' exchanges a step (the wrapper's ``tracker_hops``); None picks
            :func:`default_tracker_hops`.
        second_moment: where the optimizer's second moment comes from: ``"tracker"`` (every step, no message) or
            ``"sample"`` (:data:`optim.SECOND_MOMENTS`).
        second_moment_every: with ``"sample"``, steps between two samples of the mean gradient's second moment.
        mean_gradient: how a sample is averaged: ``"gossip"`` over the schedule, or ``"allreduce"``.
        mean_gradient_dtype: the dtype the gossiped sample travels in (None: the gradients').
        schedule: the schedule's name (:func:`topologies.by_name`); None picks :func:`default_schedule`.
    """

    rank: int = 4
    power_iterations: int = 2
    message_dtype: torch.dtype | None = torch.float16
    trackers: str = "sign"
    tracker_hops: int | None = None
    second_moment: str = "sample"
    second_moment_every: int = 64
    mean_gradient: str = "gossip"
    mean_gradient_dtype: torch.dtype | None = torch.bfloat16
    schedule: str | None = None

    def __post_init__(self) -> None:
        if self.trackers not in TRACKER_MIXINGS:
            raise InvalidArgumentError(f"Pipeline: trackers must be one of {TRACKER_MIXINGS}, got {self.trackers!r}")
        if self.mean_gradient not in MEAN_GRADIENT_SOURCES:
            raise InvalidArgumentError(
                f"Pipeline: mean_gradient must be one of {MEAN_GRADIENT_SOURCES}, got {self.mean_gradient!r}"
            )
        check_mean_gradient_dtype("Pipeline", self.mean_gradient_dtype)
        if self.second_moment not in optim.SECOND_MOMENTS:
            raise InvalidArgumentError(
                f"Pipeline: second_moment must be one of {optim.SECOND_MOMENTS}, got {self.second_moment!r}"
            )
        if self.tracker_hops is not None:
            check_tracker_hops(self.tracker_hops, "Pipeline")

    def build_schedule(self, n: int) -> topologies.Schedule:
        """The schedule for n ranks.

        Args:
            n: the number of ranks.

        Returns:
            ``schedule`` (or the default one) built for n.
        """
        return topologies.by_name(self.schedule or default_schedule(n), n)

    def hops(self, n: int) -> int:
        """The trackers' exchanges a step for n ranks.

        Args:
            n: the number of ranks.

        Returns:
            ``tracker_hops``, or :func:`default_tracker_hops` of n.
        """
        return default_tracker_hops(n) if self.tracker_hops is None else self.tracker_hops

    def algorithm(self) -> PowerGossip:
        """A fresh, unbound algorithm for the parameters.

        Returns:
            PowerGossip with this pipeline's rank, iterations and message dtype.
        """
        return PowerGossip(rank=self.rank, num_iterations=self.power_iterations, message_dtype=self.message_dtype)

    def tracking(self) -> str | ChocoSign:
        """The wrapper's ``gradient_tracking`` for the trackers.

        Returns:
            ``"sign"``'s :class:`gossip.ChocoSign` defaults, or ``"exact"`` / ``"powergossip"`` by name.
        """
        return self.trackers

    def wrap_module(self, module: nn.Module, comm: Communicator, **wrapper: Any) -> DecentralizedDataParallel:
        """Wrap ``module`` with this pipeline's schedule, algorithm and trackers (no optimizer).

        Args:
            module: the model, as :class:`gossip.DecentralizedDataParallel` takes it.
            comm: this rank's communicator.
            **wrapper: further :class:`gossip.DecentralizedDataParallel` arguments (``run_dir``, ``seed``, ...).

        Returns:
            The wrapper.
        """
        return DecentralizedDataParallel(
            module,
            comm,
            self.build_schedule(comm.size),
            self.algorithm(),
            gradient_tracking=self.tracking(),
            tracker_hops=self.hops(comm.size),
            mean_gradient=self.mean_gradient,
            mean_gradient_dtype=self.mean_gradient_dtype,
            **wrapper,
        )

    def optimizer(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.1,
        eps: float = 1e-8,
    ) -> optim.MomentumTrackingAdamW:
        """The optimizer over the wrapper's parameters (create it after wrapping).

        Args:
            params: the parameters or param groups.
            lr: the learning rate.
            betas: Adam's (beta1, beta2).
            weight_decay: decoupled weight decay (of groups that do not set their own).
            eps: added to the denominator.

        Returns:
            :class:`optim.MomentumTrackingAdamW` with this pipeline's ``second_moment`` (sampling every
                ``second_moment_every`` steps with ``"sample"``).
        """
        return optim.MomentumTrackingAdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, second_moment=self.second_moment,
            second_moment_every=self.sampling_every(),
        )  # fmt: skip

    def sampling_every(self) -> int:
        """The optimizer's ``second_moment_every``.

        Returns:
            ``second_moment_every`` with ``second_moment="sample"``, else 0 (:func:`optim.sampling_every`).
        """
        return optim.sampling_every(self.second_moment, self.second_moment_every)

    def wrap(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.1,
        **wrapper: Any,
    ) -> tuple[DecentralizedDataParallel, optim.MomentumTrackingAdamW]:
        """Wrap ``module`` and create its optimizer: the whole pipeline in one call.

        Weight decay applies to the matrices only (``optim.param_groups``: biases, norms and other vectors get none).

        Args:
            module: the model.
            comm: this rank's communicator.
            lr: the learning rate (schedule it with any ``torch.optim.lr_scheduler`` on the optimizer returned).
            betas: Adam's (beta1, beta2).
            weight_decay: decoupled weight decay on matrices.
            **wrapper: further :class:`gossip.DecentralizedDataParallel` arguments.

        Returns:
            The wrapper and the optimizer; train with them as with DDP and any torch optimizer.
        """
        model = self.wrap_module(module, comm, **wrapper)
        return model, self.optimizer(optim.param_groups(model.module, weight_decay), lr, betas, weight_decay)


def wrap(
    module: nn.Module,
    comm: Communicator,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
    pipeline: Pipeline | None = None,
    **wrapper: Any,
) -> tuple[DecentralizedDataParallel, optim.MomentumTrackingAdamW]:
    """The default pipeline around ``module`` (module docstring): the wrapper and its optimizer. A collective.

    >>> model, optimizer = gossip.wrap(net, comm, lr=3e-3)  # doctest: +SKIP

    Args:
        module: the model; every rank passes the same architecture.
        comm: this rank's communicator (``gossip.init()``).
        lr: the learning rate.
        betas: Adam's (beta1, beta2).
        weight_decay: decoupled weight decay on matrices.
        pipeline: the settings (default: ``Pipeline()``).
        **wrapper: further :class:`gossip.DecentralizedDataParallel` arguments (``run_dir``, ``seed``, ...).

    Returns:
        The wrapper and its optimizer.
    """
    chosen = Pipeline() if pipeline is None else pipeline
    return chosen.wrap(module, comm, lr=lr, betas=betas, weight_decay=weight_decay, **wrapper)
