"""n replicas of one model as the rows of a flat ``(n, P)`` buffer, their per-replica gradients, and their batches.

:class:`Replicas` lays a model's trainable parameters out as the library lays them into flat buckets
(:func:`gossip.algorithms.buckets.pack`: ``named_parameters`` order, back to back), one row per replica, so that
every algorithm of the engine works on whole rows and a row is bit for bit what a rank's buckets hold. Each parameter
is a ``(n, *shape)`` view of the buffer (:attr:`Replicas.views`), and so is its gradient (:attr:`Replicas.grad_views`).

The per-replica gradients, three ways (``grad_mode``):

* ``"loop"``: ``torch.func.grad_and_value`` of ``torch.func.functional_call`` of the model, replica by replica: the
  same kernels on the same shapes as a rank's own ``loss.backward()``, so the same gradients bit for bit (what the
  equivalence tests use);
* ``"vmap"``: the same function under ``torch.func.vmap`` over the replica axis (any model; on the CPU the attention
  falls back to a loop inside vmap);
* ``"batched"``: the hand-batched GPT of :mod:`experiments.scale.batched_gpt`, one forward and one backward for all
  replicas (the fast path at large n).

:class:`Batches` draws every worker's batch of a step with the library's :class:`gossip.app.corpus.ShardedBatches`
(seeded by (seed, rank, step)), so that worker i of the engine trains on exactly the tokens rank i of
``gossip.simulate`` does, and DDP on the same tokens as gossip.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import functional_call, grad_and_value, vmap

from experiments.scale import batched_gpt
from gossip.algorithms.buckets import DEFAULT_BUCKET_BYTES, Entry, pack
from gossip.app.corpus import ShardedBatches
from gossip.app.gpt import GPT, GPTConfig

GRAD_MODES = ("loop", "vmap", "batched")


def template_model(config: GPTConfig, seed: int, device: torch.device) -> GPT:
    """The model every replica starts from: ``torch.manual_seed(seed)``, then ``GPT(config)``.

    As each rank of the learning-per-step study builds it (the wrapper then broadcasts rank 0's, the same values).

    Args:
        config: the model's size.
        seed: the run's seed.
        device: where the model goes.

    Returns:
        The model.
    """
    torch.manual_seed(seed)
    return GPT(config).to(device)


class Replicas:
    """``rows`` copies of a model in one flat buffer, with a gradient buffer laid out alike (module docstring).

    Args:
        model: the template, whose trainable parameters every row starts from.
        rows: the number of replicas.
        grad_mode: one of :data:`GRAD_MODES`.
        bucket_bytes: the library's bucket size; the segments of :attr:`segments` follow it.

    Raises:
        ValueError: ``grad_mode`` is unknown, or ``"batched"`` for a model that is not a :class:`GPT`.
    """

    def __init__(self, model: torch.nn.Module, rows: int, grad_mode: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"grad_mode must be one of {GRAD_MODES}, got {grad_mode!r}")
        if grad_mode == "batched" and not isinstance(model, GPT):
            raise ValueError("grad_mode 'batched' is the hand-batched GPT; use 'loop' or 'vmap' for other models")
        self.model, self.rows, self.grad_mode = model, rows, grad_mode
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        buckets = pack(named, bucket_bytes)
        self.entries: list[Entry] = []  # offsets into the whole row (buckets end to end)
        self.segments: list[tuple[int, int]] = []  # (start, numel) of each library bucket within a row
        start = 0
        for bucket in buckets:
            self.segments.append((start, bucket.buffer.numel()))
            self.entries += [Entry(e.name, start + e.offset, e.shape) for e in bucket.entries]
            start += bucket.buffer.numel()
        self.numel = start
        device = named[0][1].device
        self.dtype = named[0][1].dtype
        self.flat = torch.cat([b.buffer for b in buckets]).to(device).unsqueeze(0).repeat(rows, 1)
        self.grad = torch.zeros_like(self.flat)
        self.views = self.views_of(self.flat)
        self.grad_views = self.views_of(self.grad)
        self.matrix_names = {name for name, p in named if p.ndim >= 2}  # optim.param_groups' decay rule

    @property
    def device(self) -> torch.device:
        """Where the buffers live."""
        return self.flat.device

    def views_of(self, flat: Tensor) -> dict[str, Tensor]:
        """Each parameter's ``(rows, *shape)`` view of a buffer laid out as :attr:`flat`.

        Args:
            flat: a ``(rows, P)`` buffer (or a leaf that requires grad: split, so that backward is one ``cat``).

        Returns:
            Parameter name -> view.
        """
        pieces = flat.split([e.numel for e in self.entries], dim=1)
        return {e.name: piece.view(flat.shape[0], *e.shape) for e, piece in zip(self.entries, pieces, strict=True)}

    def _loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return functional_call(self.model, params, (x, y))[1]

    def gradients(self, x: Tensor, y: Tensor) -> Tensor:
        """Each row's gradient of its mean loss on its own batch, written into :attr:`grad`.

        Args:
            x: tokens (rows, b, T).
            y: targets (rows, b, T).

        Returns:
            The rows' losses, (rows,), detached.
        """
        if self.grad_mode == "batched":
            leaf = self.flat.detach().requires_grad_(True)
            losses = batched_gpt.losses(self.views_of(leaf), x, y, self.model.config)
            (gradient,) = torch.autograd.grad(losses.sum(), leaf)
            self.grad.copy_(gradient)
            return losses.detach()
        names = list(self.views)
        if self.grad_mode == "vmap":
            grads, losses = vmap(grad_and_value(self._loss))(self.views, x, y)
            torch._foreach_copy_([self.grad_views[k] for k in names], [grads[k] for k in names])
            return losses.detach()
        losses = []
        step = grad_and_value(self._loss)
        for i in range(self.rows):
            grads, loss = step({k: v[i] for k, v in self.views.items()}, x[i], y[i])
            torch._foreach_copy_([self.grad_views[k][i] for k in names], [grads[k] for k in names])
            losses.append(loss.detach())
        return torch.stack(losses)

    @torch.no_grad()
    def loss_of(self, row: Tensor, batches: list[tuple[Tensor, Tensor]]) -> float:
        """The mean loss of one parameter row (e.g. the replicas' average) over ``batches``, with the module itself.

        Args:
            row: a (P,) parameter vector laid out as a row of :attr:`flat`.
            batches: the (x, y) batches.

        Returns:
            The mean of the batches' losses.
        """
        params = {k: v[0] for k, v in self.views_of(row.unsqueeze(0)).items()}
        total = sum(float(self._loss(params, x, y)) for x, y in batches)
        return total / len(batches)


def param_groups(replicas: Replicas, weight_decay: float) -> list[dict]:
    """``optim.param_groups`` for the stacked views: decay on the template's matrices, none on its vectors.

    Args:
        replicas: the replicas (their parameter views, whose ``.grad`` is set to the gradient views).
        weight_decay: the decay of the matrices.

    Returns:
        ``[decay_group, no_decay_group]`` of ``(rows, *shape)`` views, ready for any torch optimizer.
    """
    decay, no_decay = [], []
    for name, view in replicas.views.items():
        view.grad = replicas.grad_views[name]
        (decay if name in replicas.matrix_names else no_decay).append(view)
    return [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]


class Batches:
    """Every worker's batch of a step, drawn as :class:`gossip.app.corpus.ShardedBatches` draws it for that rank.

    Args:
        data: the training bytes.
        workers: the number of workers n.
        batch_size: sequences per worker.
        block_size: tokens per sequence.
        seed: the run's seed.
        device: where the batches go.
    """

    def __init__(self, data: Tensor, workers: int, batch_size: int, block_size: int, seed: int, device: torch.device):
        self.data, self.block_size, self.device = data, block_size, device
        self._ranks = [ShardedBatches(data, r, workers, batch_size, block_size, seed, "iid") for r in range(workers)]
        self._offsets = torch.arange(block_size + 1)

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Step ``step``'s tokens and targets, (n, b, T) each, int64.

        Args:
            step: the training step.

        Returns:
            (x, y).
        """
        starts = torch.stack([r.window_starts(step) for r in self._ranks])
        windows = self.data[starts[..., None] + self._offsets].long().to(self.device)
        return windows[..., :-1].contiguous(), windows[..., 1:].contiguous()
