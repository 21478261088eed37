"""Compression policies for PowerGossip: which parameters travel low-rank and which exactly.

``tagc_policy()`` is TAGC's layer selection (Polyakov et al., arXiv 2504.05638; docs/design.md D.2-D.3) carried
over to gossip of model differences: compress only the MLP matrices, the token embedding and the LM head --
where most of a transformer's bytes are -- and keep attention (its Q/K/V and output projections, the most
quality-sensitive, D.3), the positional embedding (TAGC reduces ``wpe`` uncompressed, D.2), norms, biases and
every other tensor exact. Names are recognised for

* gossip.app.gpt: ``blocks.N.mlp.fc``/``mlp.proj``, ``tok_emb`` (tied LM head); attention ``blocks.N.attn.qkv/proj``;
* nanoGPT / HF GPT-2: ``mlp.c_fc``/``mlp.c_proj``, ``wte``, ``lm_head``; attention ``attn.c_attn``/``attn.c_proj``;
* HF Llama/Mistral/OPT/BERT-style: ``mlp.gate_proj/up_proj/down_proj``, ``fc1``/``fc2``, ``mlp.dense_h_to_4h``
  /``dense_4h_to_h``, ``intermediate.dense``/``output.dense``, ``embed_tokens``, ``word_embeddings``, ``lm_head``.

The policy answers True (compress, even below PowerGossip's ``min_compression``) for a matching matrix with at
least ``min_numel`` elements, and False for everything else, so the choice is exactly the name list.
"""

from __future__ import annotations

import re

import torch

from gossip.algorithms.powergossip import Policy
from gossip.errors import InvalidArgumentError

#: Feed-forward (MLP) matrices: gossip.app.gpt, nanoGPT/HF GPT-2, Llama/Mistral, OPT, GPT-NeoX/BLOOM, BERT.
MLP_PATTERNS = (
    r"(^|\.)mlp\.(fc|proj|c_fc|c_proj|fc1|fc2|gate_proj|up_proj|down_proj|dense_h_to_4h|dense_4h_to_h)\.weight$",
    r"(^|\.)(fc1|fc2)\.weight$",
    r"(^|\.)intermediate\.dense\.weight$",
    r"(^|\.)output\.dense\.weight$",
)
#: Token embedding and LM head (often tied).
EMBEDDING_PATTERNS = (
    r"(^|\.)(tok_emb|wte|embed_tokens|word_embeddings)\.weight$",
    r"(^|\.)lm_head\.weight$",
)
#: Positional embeddings: exact under TAGC (D.2); ``tagc_policy(positional=True)`` compresses them too.
POSITIONAL_PATTERNS = (r"(^|\.)(pos_emb|wpe|embed_positions|position_embeddings)\.weight$",)
#: Attention: always exact, even if another pattern matched (e.g. BERT's ``attention.output.dense``).
ATTENTION_PATTERNS = (r"(^|\.)(attn|attention|self_attn)\.", r"(^|\.)(q_proj|k_proj|v_proj|o_proj|qkv|c_attn)\.")


def tagc_policy(*, min_numel: int = 0, positional: bool = False, extra: tuple[str, ...] = ()) -> Policy:
    """TAGC's layer selection as a PowerGossip ``policy`` (D.2-D.3).

    True for matrices (>= 2 dims, >= ``min_numel`` elements) named like an MLP matrix, the token embedding or
    the LM head (plus positional embeddings if ``positional``, plus the regular expressions in ``extra``); False
    for attention and everything else.

    Args:
        min_numel: the fewest elements a compressed matrix has.
        positional: compress positional embeddings too.
        extra: further regular expressions of parameter names to compress.

    Returns:
        The policy, ``(name, shape) -> bool``.

    Raises:
        InvalidArgumentError: ``min_numel`` is not an integer >= 0.
    """
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise InvalidArgumentError(f"tagc_policy: min_numel must be an integer >= 0, got {min_numel!r}")
    selected = [*MLP_PATTERNS, *EMBEDDING_PATTERNS, *(POSITIONAL_PATTERNS if positional else ()), *extra]
    compress = [re.compile(pattern) for pattern in selected]
    attention = [re.compile(pattern) for pattern in ATTENTION_PATTERNS]

    def policy(name: str, shape: torch.Size) -> bool:
        if len(shape) < 2 or shape.numel() < min_numel or any(p.search(name) for p in attention):
            return False
        return any(p.search(name) for p in compress)

    return policy
