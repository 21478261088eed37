"""TAGC's layer-selective preset (docs/design.md D.2-D.3) picks exactly the MLP, token-embedding and LM-head
matrices."""

from __future__ import annotations

import pytest
import torch

import gossip
import topologies
from gossip.algorithms.buckets import bucket_parameters
from gossip.algorithms.presets import tagc_policy
from gossip.app.gpt import GPT, GPTConfig

NANOGPT = {
    "transformer.wte.weight": (50304, 768),
    "transformer.wpe.weight": (1024, 768),
    "transformer.h.0.ln_1.weight": (768,),
    "transformer.h.0.attn.c_attn.weight": (2304, 768),
    "transformer.h.0.attn.c_proj.weight": (768, 768),
    "transformer.h.0.mlp.c_fc.weight": (3072, 768),
    "transformer.h.0.mlp.c_fc.bias": (3072,),
    "transformer.h.0.mlp.c_proj.weight": (768, 3072),
    "lm_head.weight": (50304, 768),
}
LLAMA = {
    "model.embed_tokens.weight": (32000, 4096),
    "model.layers.0.self_attn.q_proj.weight": (4096, 4096),
    "model.layers.0.self_attn.o_proj.weight": (4096, 4096),
    "model.layers.0.mlp.gate_proj.weight": (11008, 4096),
    "model.layers.0.mlp.up_proj.weight": (11008, 4096),
    "model.layers.0.mlp.down_proj.weight": (4096, 11008),
    "model.layers.0.input_layernorm.weight": (4096,),
    "lm_head.weight": (32000, 4096),
}
BERT = {
    "bert.embeddings.word_embeddings.weight": (30522, 768),
    "bert.embeddings.position_embeddings.weight": (512, 768),
    "bert.encoder.layer.0.attention.self.query.weight": (768, 768),
    "bert.encoder.layer.0.attention.output.dense.weight": (768, 768),
    "bert.encoder.layer.0.intermediate.dense.weight": (3072, 768),
    "bert.encoder.layer.0.output.dense.weight": (768, 3072),
}


def selected(names: dict[str, tuple[int, ...]], **options) -> set[str]:
    policy = tagc_policy(**options)
    return {name for name, shape in names.items() if policy(name, torch.Size(shape))}


def describe_gpt(comm: gossip.Communicator, policy) -> dict[str, list[str]]:
    torch.manual_seed(0)
    algorithm = gossip.PowerGossip(rank=1, policy=policy)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), bucket_parameters(GPT(GPTConfig(n_layer=2))))
    return algorithm.describe()


def test_tagc_on_gossip_gpt_compresses_exactly_mlp_and_tied_embedding():
    described = gossip.simulate(2, describe_gpt, tagc_policy())[0]
    mlp = {f"blocks.{i}.mlp.{layer}.weight" for i in range(2) for layer in ("fc", "proj")}
    assert set(described["compressed"]) == mlp | {"tok_emb.weight"}
    assert "pos_emb.weight" in described["exact"] and "blocks.0.attn.qkv.weight" in described["exact"]


def test_tagc_on_nanogpt_names():
    expected = {"transformer.wte.weight", "lm_head.weight"}
    assert selected(NANOGPT) == expected | {"transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}


def test_tagc_on_llama_names():
    mlp = {f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert selected(LLAMA) == mlp | {"model.embed_tokens.weight", "lm_head.weight"}


def test_tagc_on_bert_names_keeps_attention_output_exact():
    mlp = {"bert.encoder.layer.0.intermediate.dense.weight", "bert.encoder.layer.0.output.dense.weight"}
    assert selected(BERT) == mlp | {"bert.embeddings.word_embeddings.weight"}


def test_positional_option_adds_positional_embeddings():
    assert selected(NANOGPT, positional=True) - selected(NANOGPT) == {"transformer.wpe.weight"}


def test_min_numel_keeps_small_matrices_exact():
    assert selected(NANOGPT, min_numel=3_000_000) == {"transformer.wte.weight", "lm_head.weight"}


def test_bad_min_numel_is_refused():
    with pytest.raises(ValueError, match="min_numel"):
        tagc_policy(min_numel=-1)
