"""``torch.compile`` on the inner module, the supported way to compile: one graph per rank, the eager bits.

``torch.compile(net)`` before wrapping traces the module's forward once per rank (no graph break, no recompile
when the wrapper moves the parameters into its buckets or mixes them), and with the ``eager`` graph backend the
trained parameters equal those of the uncompiled module bit for bit, so the gossip around it is unchanged.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

import gossip
import topologies

N = 2
STEPS = 3
INIT = threading.Lock()  # the virtual ranks are threads, and torch's global generator is one for all of them


def train(compile_with=None):
    def run(comm: gossip.Communicator) -> list[torch.Tensor]:
        with INIT:  # seed and draw in one go, or the two ranks' draws interleave and rank 0's start differs by run
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
        if compile_with is not None:
            net = torch.compile(net, backend=compile_with)
        model = gossip.DecentralizedDataParallel(net, comm, topologies.ring(comm.size), gossip.ExactGossip())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(comm.rank)
        for _ in range(STEPS):
            x = torch.randn(4, 8, generator=generator)
            nn.functional.mse_loss(model(x), x[:, :2]).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.close()
        return [value.clone() for value in model.module.state_dict().values()]

    return gossip.simulate(N, run)


def test_compiled_inner_module_traces_once_per_rank_and_trains_to_the_eager_bits():
    graphs: list[str] = []
    lock = threading.Lock()

    def counting_eager_backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        with lock:
            graphs.append(threading.current_thread().name)
        return graph.forward

    eager = train()
    compiled = train(counting_eager_backend)
    assert sorted(graphs) == sorted(f"sim-rank-{rank}" for rank in range(N))
    for rank in range(N):
        assert all(torch.equal(a, b) for a, b in zip(eager[rank], compiled[rank], strict=True)), rank
