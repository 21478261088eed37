"""The GPT of :mod:`gossip.app.gpt` written by hand over a replica axis: R models in one forward.

``losses(params, idx, targets)`` takes every parameter stacked as ``(R, *shape)`` (the names of
``GPT.named_parameters()``) and tokens ``(R, b, T)``, and returns each replica's mean cross-entropy, ``(R,)``. The
operations are the module's, batched: every linear layer is one ``baddbmm`` over the replicas, the R x b sequences
are one batch of ``scaled_dot_product_attention`` (so a GPU runs its fused kernels, which ``torch.func.vmap`` of the
module does not reach on the CPU), a LayerNorm is ``layer_norm`` without affine followed by the replica's weight and
bias, and the embedding is one ``embedding`` lookup into the R tables laid end to end. The sum of the returned losses
has each replica's own gradient as its gradient with respect to that replica's parameters (the replicas share
nothing), so one backward gives all R gradients.

It is a second implementation of the model, equal to it up to the rounding of the batched kernels (a test pins the
losses and gradients against ``torch.func.functional_call`` of :class:`gossip.app.gpt.GPT` on each replica). Dropout
is not implemented: the configuration must have ``dropout=0``, as the studies use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gossip.app.gpt import GPTConfig

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which gossip.app.gpt uses


def _linear(x: Tensor, params: dict[str, Tensor], prefix: str) -> Tensor:
    """``x @ W^T + b`` per replica: x (R, rows, in), W (R, out, in), b (R, out) or absent."""
    weight = params[f"{prefix}.weight"]
    bias = params.get(f"{prefix}.bias")
    if bias is None:
        return torch.bmm(x, weight.mT)
    return torch.baddbmm(bias.unsqueeze(1), x, weight.mT)


def _layer_norm(x: Tensor, params: dict[str, Tensor], prefix: str) -> Tensor:
    """LayerNorm over the last dimension with each replica's weight (and bias)."""
    normed = F.layer_norm(x, x.shape[-1:], eps=LAYER_NORM_EPS)
    normed = normed * params[f"{prefix}.weight"].unsqueeze(1)
    bias = params.get(f"{prefix}.bias")
    return normed if bias is None else normed + bias.unsqueeze(1)


def _attention(x: Tensor, params: dict[str, Tensor], prefix: str, config: GPTConfig, batch: int) -> Tensor:
    """Causal self-attention of every replica's ``batch`` sequences, as one SDPA batch of R x batch sequences."""
    replicas, rows, channels = x.shape
    time, heads = rows // batch, config.n_head
    qkv = _linear(x, params, f"{prefix}.qkv")  # (R, b T, 3C)
    q, k, v = (
        t.reshape(replicas * batch, time, heads, channels // heads).transpose(1, 2) for t in qkv.split(channels, dim=2)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(replicas, rows, channels)
    return _linear(y, params, f"{prefix}.proj")


def losses(params: dict[str, Tensor], idx: Tensor, targets: Tensor, config: GPTConfig) -> Tensor:
    """Each replica's mean cross-entropy on its own batch.

    Args:
        params: every parameter of :class:`gossip.app.gpt.GPT` by name, stacked as (R, *shape).
        idx: tokens of shape (R, b, T), T <= ``config.block_size``.
        targets: the next tokens, of the same shape.
        config: the model's configuration (``dropout`` must be 0).

    Returns:
        The R losses, shape (R,).

    Raises:
        ValueError: the configuration has dropout.
    """
    if config.dropout:
        raise ValueError("batched_gpt.losses: dropout is not implemented; use GPTConfig(dropout=0.0)")
    replicas, batch, time = idx.shape
    tokens = params["tok_emb.weight"]  # (R, V, C), also the LM head
    vocab, channels = tokens.shape[1:]
    offsets = (torch.arange(replicas, device=idx.device) * vocab).view(replicas, 1, 1)
    x = F.embedding(idx + offsets, tokens.reshape(replicas * vocab, channels))  # (R, b, T, C)
    x = (x + params["pos_emb.weight"][:, :time].unsqueeze(1)).reshape(replicas, batch * time, channels)
    for layer in range(config.n_layer):
        prefix = f"blocks.{layer}"
        x = x + _attention(_layer_norm(x, params, f"{prefix}.ln1"), params, f"{prefix}.attn", config, batch)
        hidden = F.gelu(_linear(_layer_norm(x, params, f"{prefix}.ln2"), params, f"{prefix}.mlp.fc"))
        x = x + _linear(hidden, params, f"{prefix}.mlp.proj")
    logits = torch.bmm(_layer_norm(x, params, "ln_f"), tokens.mT)  # (R, b T, V)
    per_token = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="none")
    return per_token.view(replicas, -1).mean(dim=1)
