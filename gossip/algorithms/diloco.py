r"""DiLoCo: H local steps, then an all-reduce of the pseudo-gradient and an outer Nesterov-SGD step.

Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen, "DiLoCo: Distributed Low-Communication
Training of Language Models" (arXiv 2311.08105, 2023), Algorithm 1. Every worker holds the synchronised
parameters :math:`\theta` (the same on every rank) and its own replica :math:`x_i`. It trains :math:`x_i` alone
(the inner optimizer, AdamW in the paper: the user's optimizer here) and, every H steps,

1. takes its pseudo-gradient :math:`\Delta_i = \theta - x_i` (the old global parameters minus the new local ones);
2. averages it over the n workers by an all-reduce, :math:`\Delta = \frac1n \sum_i \Delta_i`;
3. applies the outer optimizer to :math:`\theta` with :math:`\Delta` as its gradient -- SGD with Nesterov momentum
   :math:`\mu` and learning rate :math:`\alpha` (0.9 and 0.7 in the paper and its reproductions):

   .. math::  v \leftarrow \mu v + \Delta, \qquad \theta \leftarrow \theta - \alpha\,(\Delta + \mu v)

   (``nesterov=False``: :math:`\theta \leftarrow \theta - \alpha v`; :math:`\mu = 0`: :math:`\theta \leftarrow
   \theta - \alpha \Delta`, no buffer);
4. sets :math:`x_i \leftarrow \theta`.

Nothing is communicated between two synchronisations. With :math:`\alpha = 1, \mu = 0` step 3 is
:math:`\theta \leftarrow \bar x`, the exact average (local SGD / :class:`gossip.PeriodicAverage`).

It is :class:`gossip.algorithms.outer.OuterOptimizer` with :class:`gossip.AllReduce` as the averaging (that
class holds the code; this one fixes the averaging, keeps the four settings of the paper as its config and checks
the ranks' agreement after a load). The update of step 3 is :func:`outer_step`:
``torch.optim.SGD(momentum=mu, nesterov=True)``'s single-tensor update (dampening 0, no weight decay), its
operations in the same order, so it gives torch's bits on the same inputs (the tests compare it with torch's SGD,
with the formula above in float64 and with ``torchft.local_sgd.DiLoCo``). Like torch, the first outer step sets
:math:`v \leftarrow \Delta`.

Time line. The synchronisation steps are those t with (t + 1) % H == 0, as :class:`gossip.PeriodicAverage`'s
averaging steps. ``start(t)`` of such a step reads :math:`x_t` (the parameters after step t - 1's update: the
wrapper starts step t's exchange right after it), computes :math:`\Delta_i` into a new buffer per bucket and posts
one non-blocking all-reduce (mean) of each; forward and backward of step t run meanwhile. ``finish`` (at step t's
``optimizer.step()``, before the update) waits, applies the outer step and writes :math:`\theta` into the
buckets; step t's update is then applied to :math:`\theta`. So the pseudo-gradient of every synchronisation but
the first spans H local updates (steps t - H ... t - 1); the first spans H - 1 (steps 0 ... H - 2, from the
parameters at construction). Step t's gradient is taken at :math:`x_t`, before the outer step: the one-step
overlap of every algorithm of the wrapper (docs/design.md B.1, G). Other steps do nothing and send nothing.

Invariant: every rank holds the same :math:`\theta` and :math:`v`, bit for bit. :meth:`DiLoCo.setup` broadcasts
rank 0's parameters into :math:`\theta` (as the wrapper broadcasts them into the replicas), and every outer step
applies the same all-reduced :math:`\Delta` (the same bits on every rank: the communicators' all-reduce) to the
same :math:`\theta, v` by the same operations. After a synchronisation every replica is :math:`\theta`. A state
loaded with :meth:`DiLoCo.load_state_dict` (checkpoint resume) is compared across ranks at the next ``start`` (one
``all_gather_object`` of a SHA-256 of it), so files from different ranks' histories are refused there.

Cost: per synchronisation a ring all-reduce of the model, :math:`2\frac{n-1}{n} M` bytes per rank for M bytes of
parameters (booked as :class:`gossip.AllReduce` books it), :math:`2\frac{n-1}{nH} M` per step on average: 1/H of a
gradient all-reduce's (DDP's) bytes. Memory: :math:`\theta` and :math:`v` (two copies of the parameters on their
device; no :math:`v` with :math:`\mu = 0`), plus the pseudo-gradients while a synchronisation is in flight.

Non-finite input: the mean pseudo-gradient is checked (one ``isfinite(...).all()`` per bucket); if it holds NaN or
Inf, :class:`gossip.errors.NonFiniteError` names the ranks whose replicas hold NaN or Inf (there is no "drop":
an outer step without some workers' progress is not DiLoCo's).
"""

from __future__ import annotations

from typing import Any

from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.outer import OuterOptimizer, outer_step

__all__ = ["LOCAL_STEPS", "OUTER_LR", "OUTER_MOMENTUM", "DiLoCo", "outer_step"]

#: The defaults: H = 20 local steps between synchronisations (1/20 of DDP's bytes, the project's byte budget, and
#: 25 outer steps in the main job's 500), and the outer Nesterov SGD of the paper and its reproductions
#: (OpenDiLoCo, torchft's examples): lr 0.7, momentum 0.9.
LOCAL_STEPS = 20
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


class DiLoCo(OuterOptimizer):
    r"""DiLoCo (module docstring): ``local_steps`` local steps, then the mean pseudo-gradient's outer step.

    ``DiLoCo(local_steps=20, outer_lr=0.7, outer_momentum=0.9)`` synchronises on steps 19, 39, ... with Nesterov
    SGD as the outer optimizer (``nesterov=False``: heavy-ball momentum). Needs no schedule: the synchronisation is
    an all-reduce over all ranks. ``OuterOptimizer(AllReduce(), ...)`` computes the same bits; this class is the
    baseline's name and config.

    Args:
        local_steps: H, steps between synchronisations, an integer >= 1.
        outer_lr: the outer learning rate, positive and finite.
        outer_momentum: :math:`\mu` of the outer optimizer, in [0, 1).
        nesterov: Nesterov momentum (True) or heavy-ball (False).

    Raises:
        InvalidArgumentError: a setting is out of range or of the wrong kind.
    """

    name = "diloco"
    _label = "DiLoCo"

    def __init__(
        self,
        local_steps: int = LOCAL_STEPS,
        outer_lr: float = OUTER_LR,
        outer_momentum: float = OUTER_MOMENTUM,
        nesterov: bool = True,
    ):
        super().__init__(AllReduce(), local_steps, outer_lr, outer_momentum, nesterov)

    def config(self) -> dict[str, Any]:
        """The settings every rank must share: ``local_steps``, ``outer_lr``, ``outer_momentum``, ``nesterov``.

        Returns:
            Setting name -> value.
        """
        return {
            "local_steps": self.local_steps,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
        }
