"""Properties of the byte-level GPT (gossip/app/gpt.py)."""

import math

import pytest
import torch

from gossip.app.gpt import GPT, GPTConfig


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core machine two spinning OpenMP threads made a step ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_bytes(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=generator)


def make_model(seed: int = 0, **config: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**config))


def test_gpt_loss_at_init_is_close_to_uniform_over_256_bytes():
    model = make_model()
    idx, targets = random_bytes((8, 64), seed=1), random_bytes((8, 64), seed=2)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_gpt_logits_have_shape_batch_time_vocab_and_no_loss_without_targets():
    logits, loss = make_model()(random_bytes((3, 17)))
    assert logits.shape == (3, 17, 256)
    assert loss is None


def test_gpt_adam_overfits_a_fixed_batch():
    model = make_model()
    idx = random_bytes((4, 32))
    targets = torch.roll(idx, shifts=-1, dims=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    _, initial_loss = model(idx, targets)
    for _ in range(30):
        _, loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    _, final_loss = model(idx, targets)
    assert initial_loss.item() > 5.0
    assert final_loss.item() < 1.0


def test_gpt_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = make_model().eval()
    idx = random_bytes((2, 32))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    logits, _ = model(idx)
    logits_changed, _ = model(changed)
    torch.testing.assert_close(logits_changed[:, :20], logits[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(logits_changed[:, 20], logits[:, 20])


def test_gpt_parameter_names_carry_layer_roles():
    names = [name for name, _ in make_model().named_parameters()]
    for role in ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"):
        assert sum(name.endswith(role) for name in names) == 2, role  # one per layer, 2 layers
    assert "tok_emb.weight" in names
    assert "pos_emb.weight" in names


def test_gpt_lm_head_is_tied_to_token_embedding():
    model = make_model()
    assert model.lm_head.weight is model.tok_emb.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_gpt_num_parameters_counts_tied_weight_once():
    model = make_model()
    c, vocab, block, layers = 128, 256, 64, 2
    per_layer = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    expected = vocab * c + block * c + layers * per_layer + 2 * c
    assert model.num_parameters() == expected


def test_gpt_residual_projections_use_depth_scaled_init():
    model = make_model(n_layer=8, n_embd=256)
    expected_std = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        for weight in (block.attn.proj.weight, block.mlp.proj.weight):
            assert abs(weight.std().item() - expected_std) < 0.1 * expected_std
        assert abs(block.mlp.fc.weight.std().item() - 0.02) < 0.002


def test_gpt_same_seed_gives_identical_weights():
    first, second = make_model(seed=7).state_dict(), make_model(seed=7).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    other = make_model(seed=8).state_dict()
    assert not torch.equal(first["tok_emb.weight"], other["tok_emb.weight"])


def test_gpt_generate_appends_tokens_past_block_size_reproducibly():
    model = make_model(block_size=8).eval()
    prompt = random_bytes((2, 5))
    torch.manual_seed(3)
    sample = model.generate(prompt, max_new_tokens=12, top_k=10)
    torch.manual_seed(3)
    again = model.generate(prompt, max_new_tokens=12, top_k=10)
    assert sample.shape == (2, 17)
    assert torch.equal(sample[:, :5], prompt)
    assert torch.equal(sample, again)


def test_gpt_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        make_model(block_size=8)(random_bytes((1, 9)))


def test_gpt_config_refuses_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=130, n_head=4)
