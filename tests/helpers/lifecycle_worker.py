"""Worker for tests/test_lifecycle.py, started by torchrun (4 processes): process groups and exit without ceremony.

Usage: python tests/helpers/lifecycle_worker.py OUT_DIR MODE

* ``adopt``: the script creates the default Gloo group itself (as DDP tutorials do), then ``gossip.init()`` adopts
  it and trains :func:`train_a_few_steps`; ``gossip.init(group=...)`` adopts a subgroup ({0, 2} or {1, 3}) and
  exchanges over it; after both communicators are closed, the script's own group still works and the script
  destroys it. Each rank saves ``rank<r>.pt``.
* ``no_close``: the README's loop as a user copies it, never calling ``model.close()`` or ``comm.close()``. An atexit
  handler registered *before* ``gossip.init`` runs *after* the library's (atexit runs handlers last in, first out)
  and writes the process's thread names to ``rank<r>.threads``: no Gloo thread may be left at that point, since one
  that lives into interpreter finalization aborts the process.
* ``raise``: every rank raises the same uncaught exception at the same step (an exchange is in flight).
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gossip
import topologies
from helpers.gloo_threads import thread_names_once_gloo_ended

TIMEOUT = 30.0
STEPS = 3


def train_a_few_steps(comm: gossip.Communicator) -> dict[str, torch.Tensor]:
    """Exact gossip on a ring, SGD, data seeded per rank: the parameters after STEPS steps (simulator-comparable)."""
    generator = torch.Generator().manual_seed(comm.rank)
    net = nn.Linear(6, 2)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    model = gossip.DecentralizedDataParallel(net, comm, topologies.ring(comm.size), gossip.ExactGossip())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(4, 6, generator=generator)
        nn.functional.mse_loss(model(x), x[:, :2]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.close()
    return {name: value.detach().clone() for name, value in model.module.state_dict().items()}


def adopt(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = gossip.init(timeout=TIMEOUT)
    result: dict = {"rank_size": (comm.rank, comm.size, comm.local_rank, comm.local_size), "backend": comm.backend}
    result["trained"] = train_a_few_steps(comm)
    halves = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    sub = gossip.init(group=halves[rank % 2], timeout=TIMEOUT)
    result["sub_rank_size"] = (sub.rank, sub.size)
    received = torch.zeros(1)
    sub.exchange([(1 - sub.rank, torch.tensor([float(rank)]))], [(1 - sub.rank, received)], seq=0).wait()
    result["sub_received"] = received.item()
    total = torch.tensor([float(rank)])
    sub.all_reduce(total, "sum")
    result["sub_sum"] = total.item()
    sub.close()
    comm.close()
    result["still_initialized"] = dist.is_initialized()
    world_sum = torch.tensor([float(rank)])
    dist.all_reduce(world_sum)  # the script's own group outlives the library's communicators
    result["world_sum_after_close"] = world_sum.item()
    torch.save(result, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


def no_close(out_dir: Path) -> None:
    def report_threads() -> None:
        (out_dir / f"rank{comm.rank}.threads").write_text("\n".join(thread_names_once_gloo_ended()))

    atexit.register(report_threads)
    comm = gossip.init(timeout=TIMEOUT)  # the README's loop from here on, without close()
    model = gossip.DecentralizedDataParallel(nn.Linear(6, 2), comm, topologies.ring(comm.size), gossip.ExactGossip())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(4, 6)
        nn.functional.mse_loss(model(x), x[:, :2]).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save({"rank": comm.rank}, out_dir / f"rank{comm.rank}.pt")


def raise_everywhere(out_dir: Path) -> None:
    comm = gossip.init(timeout=TIMEOUT)
    model = gossip.DecentralizedDataParallel(nn.Linear(6, 2), comm, topologies.ring(comm.size), gossip.ExactGossip())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(4, 6)
        nn.functional.mse_loss(model(x), x[:, :2]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            raise ValueError(f"rank {comm.rank}: the user's own error at step {step}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"adopt": adopt, "no_close": no_close, "raise": raise_everywhere}[sys.argv[2]](Path(sys.argv[1]))
