"""gossip-train's command line: --help states each default once, and --optimizer builds the optimizer it names."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import optim
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import TrainConfig, make_optimizer, resolve

OPTION_LINE = re.compile(r"^  -")


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's lines of ``--help`` (its flag line and the indented help below it), by its first flag."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in help_text.splitlines():
        if OPTION_LINE.match(line):
            current = blocks.setdefault(line.split()[0].rstrip(","), [])
        elif not line.startswith(" "):
            current = None  # a group heading or a blank line ends the block
        if current is not None:
            current.append(line)
    return {flag: " ".join(lines) for flag, lines in blocks.items()}


@pytest.fixture(scope="module")
def help_text() -> str:
    run = subprocess.run(
        [sys.executable, "-m", "gossip.app.cli", "--help"], capture_output=True, text=True, check=True, timeout=120
    )
    return run.stdout


def test_help_names_no_none_default(help_text: str) -> None:
    assert "(default: None)" not in help_text
    assert "default: None" not in " ".join(help_text.split())


def test_help_states_each_option_default_at_most_once(help_text: str) -> None:
    blocks = option_blocks(help_text)
    assert {"--nproc", "--steps", "--power-iterations", "--accum-iter", "--out"} <= set(blocks)
    doubled = {flag: text for flag, text in blocks.items() if text.lower().count("default") > 1}
    assert doubled == {}


def test_help_still_states_the_defaults(help_text: str) -> None:
    blocks = option_blocks(help_text)
    assert "(default: 500)" in blocks["--steps"]
    assert "default: 2" in blocks["--power-iterations"] and "default: max(1, workers // 4)" in blocks["--accum-iter"]


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))


def test_adamw_is_torch_adamw_and_accum_adamw_the_accumulating_one() -> None:
    config, _ = resolve(TrainConfig(optimizer="adamw"), world_size=8)
    adamw = make_optimizer(config, tiny_gpt())
    assert type(adamw) is torch.optim.AdamW
    accum_config, _ = resolve(TrainConfig(optimizer="accum-adamw"), world_size=8)
    accum = make_optimizer(accum_config, tiny_gpt())
    assert type(accum) is optim.AccumAdamW and accum.defaults["accum_iter"] == 2  # max(1, 8 // 4)
    for ours, theirs in zip(adamw.param_groups, accum.param_groups, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert ours[key] == theirs[key], key
        assert [p.shape for p in ours["params"]] == [p.shape for p in theirs["params"]]


def test_adamw_takes_accum_adamw_steps_with_accum_iter_one() -> None:
    """AccumAdamW(accum_iter=1) is AdamW's update rule: given the same gradients at every step, the two optimizers
    move the GPT alike (not bit for bit: the kernels round differently). The gradients are model 0's, copied to
    model 1, so that a rounding difference in one update is not amplified through the next steps' forward passes
    (Adam's normalisation turns last-bit differences of tiny gradients into visible ones)."""
    config, _ = resolve(TrainConfig(optimizer="adamw"), world_size=1)
    models = [tiny_gpt(), tiny_gpt()]
    optimizers = [
        make_optimizer(config, models[0]),
        optim.AccumAdamW(
            optim.param_groups(models[1], config.weight_decay), lr=config.lr, betas=(0.9, 0.95), eps=1e-8, accum_iter=1
        ),
    ]
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randint(0, 16, (4, 8), generator=generator)
        _, loss = models[0](x, x)
        loss.backward()
        for ours, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
            theirs.grad = ours.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for ours, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
