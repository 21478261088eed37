r"""Local update rules for decentralized training. Nothing in this package communicates.

Decentralization enters only through the order of operations that the wrapper
(``gossip.DecentralizedDataParallel``) enforces around an ordinary ``torch.optim.Optimizer``
(docs/design.md B.1 and G; Decent-DP's schema, arXiv 2410.11998):

.. math::

    x_i^{t+1} = \sum_j W_{ij}(t)\, x_j^{t} \;-\; \eta\, d_i^{t}\big(g_i(x_i^{t})\big)

1. the exchange of :math:`x^t` with step t's peers starts right after step t-1's update;
2. forward and backward at :math:`x_i^t` give the local gradient :math:`g_i(x_i^t)` meanwhile;
3. at ``optimizer.step()`` time the wrapper writes the mixed parameters :math:`\sum_j W_{ij} x_j^t` into the
   model, then the optimizer applies its direction :math:`d` computed from :math:`g_i(x_i^t)`.

Optimizer state (momentum buffers, Adam moments, AccumAdam's accumulator) stays local and is never mixed, except
the first moment of :class:`MomentumTrackingAdamW`, which the optimizer hands to the wrapper's gradient tracker
through ``.grad``.

Contents:

- :data:`SGD` is ``torch.optim.SGD`` itself. With the order above it *is* D-PSGD, and with
  ``momentum=0.9, nesterov=True`` it is the decentralized SGD with Nesterov momentum used by PowerGossip's
  reference (docs/design.md A.7): the local rule is unchanged, so it is not re-implemented here.
- :class:`AccumAdam` / :class:`AccumAdamW`: Adam / AdamW whose moments advance once per ``accum_iter`` local
  steps with the mean of the last local gradients (docs/design.md B.3). ``accum_iter=1`` gives Adam / AdamW,
  i.e. DAdam under the order above.
- :class:`MomentumTrackingAdamW`: AdamW whose first moment the wrapper's gradient tracker averages over the ranks
  (momentum tracking), divided by the mean gradient's second moment, read off the tracker every step or sampled
  every few steps (:data:`SECOND_MOMENTS`; :func:`sampling_every` gives its ``second_moment_every`` for a
  configured pair).
- :func:`param_groups`: weight decay on ``ndim >= 2`` weights, none on biases and normalisation parameters.
"""

from torch.optim import SGD

from optim.accum_adam import AccumAdam, AccumAdamW
from optim.momentum_tracking import SECOND_MOMENTS, MomentumTrackingAdamW, sampling_every
from optim.weight_decay_groups import param_groups

__all__ = [
    "SECOND_MOMENTS",
    "SGD",
    "AccumAdam",
    "AccumAdamW",
    "MomentumTrackingAdamW",
    "param_groups",
    "sampling_every",
]
