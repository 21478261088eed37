"""A small byte-level GPT, the default model of `gossip-train`.

The shape follows nanoGPT (karpathy/nanoGPT, `model.py`), which follows GPT-2 (Radford et al., 2019):

    h_0     = tok_emb[idx] + pos_emb[0..T-1]                       token + learned position embeddings
    h'_l    = h_{l-1} + attn.proj(CausalSelfAttention(ln1(h_{l-1})))   pre-LayerNorm residual blocks
    h_l     = h'_l + mlp.proj(GELU(mlp.fc(ln2(h'_l))))             MLP with a hidden width 4 * n_embd
    logits  = ln_f(h_L) @ tok_emb.weightᵀ                          LM head tied to the token embedding
    loss    = cross_entropy(logits, targets)

Tokens are raw bytes (vocab_size 256), so no tokenizer is needed; a uniform guess over the 256 bytes has the
loss ln(256) ≈ 5.545, where training starts.

Parameter names say which role a matrix plays, because compression (docs/design.md D.2, layer-selective
compression) treats roles differently: MLP matrices `*.mlp.fc.weight` and `*.mlp.proj.weight`, the embeddings
`tok_emb.weight` (which is also the LM head, tied, so it appears once in `named_parameters()`) and
`pos_emb.weight`; attention matrices `*.attn.qkv.weight` and `*.attn.proj.weight` are kept exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gossip.errors import InvalidArgumentError


@dataclass
class GPTConfig:
    """Model size; the defaults are the main job's model (437 760 parameters).

    Attributes:
        block_size: the context length in tokens.
        vocab_size: the number of token values (256 bytes).
        n_layer: the number of transformer blocks.
        n_head: attention heads per block (divides ``n_embd``).
        n_embd: the width of the residual stream.
        dropout: the dropout probability, in [0, 1).
        bias: whether the linear layers and LayerNorms have biases.
    """

    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise InvalidArgumentError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidArgumentError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends only to positions <= t.

    Args:
        config: the model size.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over the sequence.

        Args:
            x: activations of shape (B, T, n_embd).

        Returns:
            The attention output, of the same shape.
        """
        batch, time, channels = x.shape
        # (B, T, 3C) -> three tensors of shape (B, n_head, T, head_size)
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer: proj(GELU(fc(x))) with a hidden width 4 * n_embd.

    Args:
        config: the model size.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer at every position.

        Args:
            x: activations of shape (B, T, n_embd).

        Returns:
            The output, of the same shape.
        """
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)).

    Args:
        config: the model size.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: activations of shape (B, T, n_embd).

        Returns:
            The output, of the same shape.
        """
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model over bytes (see the module docstring for the math).

    Args:
        config: the model size (default :class:`GPTConfig`'s defaults).
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf, 2017)

        # nanoGPT / GPT-2 initialisation: N(0, 0.02) everywhere, zero biases, and the two projections that
        # write into the residual stream are scaled by 1/sqrt(2 * n_layer) so its variance stays bounded.
        self.apply(_init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, parameter in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(parameter, mean=0.0, std=residual_std)

    def num_parameters(self) -> int:
        """Number of distinct parameters (the tied embedding / LM head counted once).

        Returns:
            The count.
        """
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for int64 tokens ``idx``, and the mean cross-entropy if ``targets`` are given.

        Args:
            idx: tokens of shape (B, T), T <= block_size.
            targets: the next tokens, of the same shape, or None.

        Returns:
            Logits of shape (B, T, vocab_size) and the loss (None without targets).

        Raises:
            InvalidArgumentError: T exceeds block_size.
        """
        _, time = idx.shape
        if time > self.config.block_size:
            raise InvalidArgumentError(f"sequence length {time} exceeds block_size {self.config.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T), feeding back the last block_size tokens.

        Sampling uses torch's global RNG, so it is reproducible after torch.manual_seed.

        Args:
            idx: the prompt, tokens of shape (B, T).
            max_new_tokens: how many tokens to append.
            temperature: divides the logits (> 0).
            top_k: sample among the k most likely tokens only, or None for all.

        Returns:
            The tokens, of shape (B, T + max_new_tokens).

        Raises:
            InvalidArgumentError: ``temperature`` is not positive.
        """
        if temperature <= 0:
            raise InvalidArgumentError(f"temperature must be > 0, got {temperature}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
