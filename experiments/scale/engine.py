"""The replica-axis engine: n workers of a gossip (or DDP) run in one process, one tensor per quantity.

:class:`Engine` holds every worker's parameters as a row of one ``(n, P)`` buffer (:class:`Replicas`) and runs the
step of :class:`gossip.DecentralizedDataParallel` on all rows at once, in its order:

1. the gradients g(x_t) of every worker on its own batch (:class:`experiments.scale.replicas.Batches`, the tokens
   rank i of the simulator draws);
2. the parameters' mixing of x_t (:func:`experiments.scale.mixing.exact_gossip_` or
   :class:`~experiments.scale.powergossip.BatchedPowerGossip`), which the library overlaps with step 1;
3. with momentum tracking: the mean gradient's sample (a hop of the one in progress, handed to the optimizer when
   it is exact; a new sample on the due steps) and the optimizer's ``prepare_momentum`` (the first moment into
   ``.grad``);
4. with trackers: y <- mix(y + g - g_prev) (adapt-then-combine, ``gossip.wrapper.tracking``), exactly
   (:func:`~experiments.scale.mixing.rank_order_sum_`) or by :class:`~experiments.scale.sign.BatchedChocoSign`,
   over W(kt), ..., W(kt + k - 1) for k ``tracker_hops``, written into ``.grad``;
5. the optimizer's update, x_{t+1} = mix(x_t) - lr d(.grad): the library's own optimizer classes
   (:class:`optim.AccumAdamW`, :class:`optim.MomentumTrackingAdamW`) stepping on the ``(n, *shape)`` views, whose
   every operation is elementwise, so each row gets the update its rank computes.

DDP (``params="ddp"``) keeps one row: the workers' gradients at it are averaged (summed in rank order, as the
simulator's all-reduce, when computed one by one; otherwise the gradient of the mean loss over all n x b sequences,
the same up to rounding) and AdamW steps once, as the learning-per-step study's DDP does. Bytes are counted per
message as the communicators count payloads (ring all-reduce: 2 (n - 1)/n of the message per rank); the peers'
comparison of settings (``gossip.wrapper.peer_agreement``) is counted on the steps the library sends it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor
from torch.func import grad_and_value

import optim
import topologies
from experiments.scale.config import EngineConfig
from experiments.scale.mixing import consensus_sq, exact_gossip_, mean_in_rank_order, rank_order_sum_
from experiments.scale.powergossip import BatchedPowerGossip
from experiments.scale.replicas import Batches, Replicas, param_groups, template_model
from experiments.scale.sign import BatchedChocoSign, directed_edges
from experiments.scale.steps import StepPlan, StepPlans, schedule_edges
from gossip.app.train import TrainConfig, learning_rate
from gossip.wrapper.mean_gradient import inexact_hops
from gossip.wrapper.peer_agreement import MESSAGE_BYTES
from gossip.wrapper.tracking import require_doubly_stochastic


class MeanGradient:
    """The mean gradient a momentum-tracking optimizer samples: gossiped along the schedule or all-reduced.

    ``"gossip"`` follows :class:`gossip.wrapper.mean_gradient.GossipedMeanGradient`: at a due step every row copies
    its gradient into the sample; from the next step at which the schedule averages exactly
    (:func:`topologies.exact_averaging_starts`) the samples are mixed over W(t) in rank order, one step at a time,
    each hop's samples first rounded to ``wire_dtype`` (the library's message precision), and handed to the optimizer
    after the schedule's hops (``inexact_hops(n)`` steps on a schedule that never averages exactly). ``"allreduce"``
    hands over the rank-order mean at once.

    Args:
        how: ``"gossip"`` or ``"allreduce"``.
        schedule: the schedule.
        replicas: the replicas (their layout).
        wire_dtype: the dtype the gossiped samples travel in; None: the gradients'.
    """

    def __init__(
        self, how: str, schedule: topologies.Schedule, replicas: Replicas, wire_dtype: torch.dtype | None = None
    ):
        self.how, self.schedule, self.replicas, self.wire_dtype = how, schedule, replicas, wire_dtype
        starts = topologies.exact_averaging_starts(schedule)
        self.hops = max(starts.values()) if starts else inexact_hops(schedule.n)
        self._starts = set(starts) if starts else None
        self.samples: Tensor | None = None
        self.remaining = self.begin_at = 0

    def _first_hop_after(self, step: int) -> int:
        t = step + 1
        while self._starts is not None and self.schedule.phase(t) not in self._starts:
            t += 1
        return t

    def _hand_over(self, optimizer: optim.MomentumTrackingAdamW, means: Tensor) -> None:
        views = self.replicas.views_of(means)
        optimizer.take_mean_gradient({p: views[name] for name, p in self.replicas.views.items()}, self.schedule.n)

    def take(self, optimizer: optim.MomentumTrackingAdamW, step: int, plan: StepPlan) -> int:
        """Step ``step``'s part: a hop of the sample in progress, then a new sample if one is due.

        Args:
            optimizer: the optimizer (its ``mean_gradient_due`` and ``take_mean_gradient``).
            step: the step.
            plan: W(step).

        Returns:
            The payload bytes every rank sent for it this step, summed over the ranks.

        Raises:
            ValueError: a sample is due while the previous one is still being averaged.
        """
        grad, n = self.replicas.grad, self.schedule.n
        row_bytes = grad.shape[1] * grad.element_size()
        sent = 0
        if self.how == "allreduce":
            if optimizer.mean_gradient_due():
                self._hand_over(optimizer, mean_in_rank_order(grad))
                sent = int(2 * (n - 1) / n * row_bytes * n)
            return sent
        if self.remaining and step >= self.begin_at:
            assert self.samples is not None
            hop_bytes = row_bytes
            if self.wire_dtype is not None and self.wire_dtype != self.samples.dtype:
                self.samples.copy_(self.samples.to(self.wire_dtype))
                hop_bytes = grad.shape[1] * self.wire_dtype.itemsize
            rank_order_sum_(self.samples, plan)
            sent = sum(len(nodes) for nodes in plan.active) * hop_bytes
            self.remaining -= 1
            if not self.remaining:
                self._hand_over(optimizer, self.samples)
        if optimizer.mean_gradient_due():
            if self.remaining:
                raise ValueError(f"step {step}: a mean-gradient sample is due while the last one needs more hops")
            self.samples = grad.clone()
            self.remaining, self.begin_at = self.hops, self._first_hop_after(step)
            if not self.remaining:
                self._hand_over(optimizer, self.samples)
        return sent


class Engine:
    """n workers of ``config`` on ``device`` (module docstring).

    Args:
        config: the run.
        train: the training bytes.
        device: where every buffer lives.
        grad_mode: how the per-worker gradients are computed (:data:`experiments.scale.replicas.GRAD_MODES`).
    """

    def __init__(self, config: EngineConfig, train: Tensor, device: torch.device | str, grad_mode: str = "batched"):
        device = torch.device(device)
        self.config, n = config, config.workers
        self.ddp = config.params == "ddp"
        self.model = template_model(config.gpt(), config.seed, device)
        self.replicas = Replicas(self.model, 1 if self.ddp else n, grad_mode)
        self.batches = Batches(train, n, config.batch, config.block_size, config.seed, device)
        self.schedule = config.build_schedule()
        self.plans = StepPlans(self.schedule, device)
        self.row_bytes = self.replicas.numel * self.replicas.flat.element_size()
        if config.params == "powergossip" or config.trackers == "sign":
            self.schedule.validate(symmetric=True)
            lo, hi = schedule_edges(self.schedule, config.steps)  # the per-edge state, reserved once
        self.powergossip = None
        if config.params == "powergossip":
            self.powergossip = BatchedPowerGossip(self.replicas, n, config.powergossip())
            self.powergossip.edge_rows(lo, hi)
        self.sign = None
        if config.trackers:
            require_doubly_stochastic(self.schedule, 0)
            self.trackers, self.previous = torch.zeros_like(self.replicas.flat), torch.zeros_like(self.replicas.flat)
        if config.trackers == "sign":
            sign = (config.sign_gamma, config.sign_chunk, config.sign_levels)
            self.sign = BatchedChocoSign(self.replicas.segments, *sign)
            self.sign.reserve(*self._messages(config.steps * config.tracker_hops), self.trackers)
        groups = param_groups(self.replicas, config.weight_decay)
        adam = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": 1e-8}
        if config.optimizer == "momentum-tracking":
            self.optimizer = optim.MomentumTrackingAdamW(
                groups, **adam, second_moment=config.second_moment, second_moment_every=config.sampling_every()
            )
        else:
            self.optimizer = optim.AccumAdamW(groups, **adam, accum_iter=1)
        self.mean_gradient = MeanGradient(config.mean_gradient, self.schedule, self.replicas, config.sample_dtype())
        self.lr_schedule = TrainConfig(lr=config.lr, steps=config.steps, warmup_steps=config.warmup_steps())
        self.bytes_sent = 0  # payload bytes, summed over the ranks

    def _messages(self, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The directed edges over ``steps`` steps (one period suffices) in the order each step lists them, so that
        a periodic one-peer schedule finds each step's public copies in consecutive rows."""
        span = steps if self.schedule.period is None else min(steps, self.schedule.period)
        pairs: dict[tuple[int, int], None] = {}
        for t in range(span):
            src, dst = directed_edges(self.plans.at(t))
            pairs.update(dict.fromkeys(zip(src.tolist(), dst.tolist(), strict=True)))
        edges = np.array(list(pairs), dtype=np.int64).reshape(-1, 2)
        return edges[:, 0], edges[:, 1]

    @property
    def parameters(self) -> Tensor:
        """Every worker's parameters, (n, P) (DDP's one row, expanded)."""
        flat = self.replicas.flat
        return flat.expand(self.config.workers, -1) if self.ddp else flat

    def _ddp_gradient(self, x: Tensor, y: Tensor) -> Tensor:
        """DDP: the workers' mean gradient at the one row, into its ``grad``; the workers' losses."""
        replicas, n = self.replicas, self.config.workers
        if replicas.grad_mode != "loop":  # the gradient of the mean over all n x b sequences
            loss = replicas.gradients(x.reshape(1, -1, x.shape[-1]), y.reshape(1, -1, y.shape[-1]))
            return loss.expand(n)
        params = {k: v[0] for k, v in replicas.views.items()}
        step = grad_and_value(replicas._loss)
        total, losses = None, []
        for i in range(n):  # as the study: each rank's gradients concatenated, summed in rank order, divided by n
            grads, loss = step(params, x[i], y[i])
            flat = torch.cat([grads[e.name].reshape(-1) for e in replicas.entries])
            total = flat if total is None else total.add_(flat)
            losses.append(loss.detach())
        replicas.grad[0].copy_(total / n)
        return torch.stack(losses)

    def step(self, t: int) -> Tensor:
        """Train step ``t`` on every worker.

        Args:
            t: the step, from 0.

        Returns:
            The workers' training losses at x_t, (n,).
        """
        config, n = self.config, self.config.workers
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.lr_schedule, t)
        x, y = self.batches.batch(t)
        if self.ddp:
            losses = self._ddp_gradient(x, y)
            self.bytes_sent += int(2 * (n - 1) / n * self.row_bytes * n)
        else:
            losses = self.replicas.gradients(x, y)
            plan = self.plans.at(t)
            self.bytes_sent += self._agreement_bytes(t, plan)
            with torch.no_grad():
                self._mix(plan)
                if config.optimizer == "momentum-tracking":
                    self.bytes_sent += self.mean_gradient.take(self.optimizer, t, plan)
                    self.optimizer.prepare_momentum()
                if config.trackers:
                    hops = config.tracker_hops
                    self._track([self.plans.at(hops * t + hop) for hop in range(hops)])
        self.optimizer.step()
        return losses

    def _agreement_bytes(self, t: int, plan: StepPlan) -> int:
        """The peers' comparison messages of step t (``gossip.wrapper.peer_agreement``): the optimizer's kind over the
        ``len(check_steps)`` steps after the first optimizer step when tracking, W(t) past an aperiodic schedule's
        window."""
        schedule = self.schedule
        optimizer = bool(self.config.trackers) and 1 <= t <= len(schedule.check_steps)
        weights = schedule.period is None and t >= schedule.window
        return MESSAGE_BYTES * sum(len(nodes) for nodes in plan.active) if optimizer or weights else 0

    def _mix(self, plan: StepPlan) -> None:
        flat = self.replicas.flat
        if self.powergossip is not None:
            self.bytes_sent += self.powergossip.mix_(flat, plan)
        else:
            exact_gossip_(flat, plan, self.config.gamma)
            self.bytes_sent += sum(len(nodes) for nodes in plan.active) * self.row_bytes

    def _track(self, plans: list[StepPlan]) -> None:
        """y <- mix(y + g - g_prev) over each of ``plans`` in turn; g_prev <- g; .grad <- y
        (``GradientTracker.track``, adapt-then-combine)."""
        grad = self.replicas.grad
        self.trackers.add_(grad).sub_(self.previous)
        self.previous.copy_(grad)
        for plan in plans:
            if self.sign is not None:
                self.bytes_sent += self.sign.mix_(self.trackers, plan)
            else:
                rank_order_sum_(self.trackers, plan)
                self.bytes_sent += sum(len(nodes) for nodes in plan.active) * self.row_bytes
        grad.copy_(self.trackers)

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[Tensor, Tensor]], probes: int = 8) -> dict[str, float]:
        """The averaged model's loss, the mean loss of up to ``probes`` workers, on ``batches``; and Xi.

        Args:
            batches: held-out (x, y) batches.
            probes: workers evaluated for the local loss (evenly spaced).

        Returns:
            ``{"avg_val_loss", "local_val_loss", "consensus"}`` (consensus: the root of Xi^2).
        """
        flat = self.replicas.flat
        average = flat.mean(dim=0)
        chosen = np.unique(np.linspace(0, flat.shape[0] - 1, min(probes, flat.shape[0])).round().astype(int))
        local = [self.replicas.loss_of(flat[i], batches) for i in chosen]
        return {
            "avg_val_loss": self.replicas.loss_of(average, batches),
            "local_val_loss": sum(local) / len(local),
            "consensus": math.sqrt(consensus_sq(flat)),
        }

    def bytes_per_worker(self) -> float:
        """The payload bytes each worker sent so far, on average.

        Returns:
            Bytes.
        """
        return self.bytes_sent / self.config.workers
