"""A small GPT trained by DecentralizedDataParallel on CUDA parameters: one function for the simulator and MPI.

Every rank seeds its own generators (never the global RNG, which simulator ranks share), so the run gives the same
numbers as virtual ranks of the simulator on one GPU and as MPI processes sharing that GPU.
"""

from __future__ import annotations

import torch

import gossip
import topologies
from gossip.algorithms import PowerGossipTuning
from gossip.app.gpt import GPT, GPTConfig
from gossip.wrapper.parallel import DecentralizedDataParallel

CONFIG = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
STEPS = 8
BATCH = 4


def train_small_gpt(
    comm: gossip.Communicator, cuda_graphs: bool = True, iterations: int = 1, during_backward: bool = True
) -> dict:
    """Train the GPT for ``STEPS`` steps on ``comm.device``; return losses, final parameters (on the CPU), how
    many CUDA graphs PowerGossip captured (None: it launched its kernels one by one) and how many power iterations
    it posted during backward. With ``iterations`` > 1 the products travel in float16 (the main job's defaults),
    and each step waits for its first exchange before backward, so that the second iteration is posted during
    backward (``during_backward``) on every rank, from the backward hooks' thread."""
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(0)  # not the global RNG: simulator ranks share it between threads
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:  # the matrices and embeddings; biases and norms start as constants
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    model = model.to(comm.device)
    algorithm = gossip.PowerGossip(
        rank=2,
        num_iterations=iterations,
        min_compression=1,
        message_dtype=torch.float16 if iterations > 1 else None,
        tuning=PowerGossipTuning(cuda_graphs=cuda_graphs, iterations_during_backward=during_backward),
    )
    wrapped = DecentralizedDataParallel(model, comm, topologies.one_peer_hypercube(comm.size), algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    generator = torch.Generator().manual_seed(100 + comm.rank)
    losses = []
    for _ in range(STEPS):
        # a learnable sequence: each row counts up from a random start (the next token is the previous + 1)
        start = torch.randint(CONFIG.vocab_size, (BATCH, 1), generator=generator)
        tokens = ((start + torch.arange(CONFIG.block_size + 1)) % CONFIG.vocab_size).to(comm.device)
        _, loss = wrapped(tokens[:, :-1], tokens[:, 1:])
        if iterations > 1:
            wrapped._exchange.handle.wait()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    wrapped.close()
    return {
        "losses": losses,
        "device": {p.device.type for p in model.parameters()},
        "parameters": [p.detach().cpu() for p in model.parameters()],
        "graphs": None if algorithm._captured is None else algorithm._captured.captured,
        "ahead": algorithm.posted_ahead,
    }
