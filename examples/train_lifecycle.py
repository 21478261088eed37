"""The whole life of a decentralized training run, as a plain PyTorch script.

init -> shard the data with ``DistributedSampler`` -> wrap the model, build the optimizer and an LR scheduler ->
train, evaluating the averaged model now and then -> checkpoint, and resume from the last checkpoint when restarted
-> close. A classifier on a synthetic data set keeps it fast; swap in your own model and data.

Launch it as any torch.distributed script (``gossip.init`` reads the launcher's environment):

    torchrun --nproc-per-node 4 examples/train_lifecycle.py --checkpoint-dir ckpt
    OMP_NUM_THREADS=1 mpiexec -n 4 python examples/train_lifecycle.py --checkpoint-dir ckpt   # mpiexec sets no
                                                                  # OMP_NUM_THREADS: 4 ranks would each use all cores
    python examples/train_lifecycle.py                             # a single process: a world of 1

Run the same command again and it resumes from the checkpoint in ``--checkpoint-dir``, bit for bit where the
uninterrupted run would have been (``--stop-at`` ends a run early, as a preempted job would).
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gossip
import topologies


def synthetic_data(n: int, seed: int) -> TensorDataset:
    """Points in 16 dimensions, labelled by which of 4 fixed random directions they point most along."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(16, 4, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, 16, generator=generator)
    return TensorDataset(x, (x @ directions).argmax(1))


@torch.no_grad()
def evaluate(model: gossip.DecentralizedDataParallel, data: TensorDataset, comm: gossip.Communicator) -> float:
    """Mean loss of the averaged model on ``data``; each rank scores a share. Every rank must call it: the
    average is computed with the peers (``averaged()`` is a collective)."""
    totals = torch.zeros(2, dtype=torch.float64)
    with model.averaged() as averaged:
        x, y = data.tensors
        totals[0] = nn.functional.cross_entropy(averaged(x[comm.rank :: comm.size]), y[comm.rank :: comm.size],
                                                reduction="sum")  # fmt: skip
        totals[1] = len(y[comm.rank :: comm.size])
    comm.all_reduce(totals, "sum")
    return float(totals[0] / totals[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--checkpoint-dir", default=None, help="save here; resume from here if it holds a checkpoint")
    parser.add_argument("--stop-at", type=int, default=None, help="end after this step, as a preempted job would")
    parser.add_argument("--out", default=None, help="write the averaged model's state_dict to OUT/model.pt")
    args = parser.parse_args()

    # 1. init: a communicator for however this process was launched (a single process gets a world of 1).
    comm = gossip.init(timeout=60.0)
    torch.manual_seed(0)  # the same initial model on every rank (the wrapper checks that they agree)

    # 2. data: every rank sees its own shard of each epoch.
    train_set, validation_set = synthetic_data(4096, seed=0), synthetic_data(512, seed=1)
    sampler = DistributedSampler(train_set, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    # 3. the wrapper, the optimizer (on the wrapper's parameters) and a scheduler.
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    model = gossip.DecentralizedDataParallel(net, comm, topologies.ring(comm.size), gossip.ExactGossip())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def warmup_cosine(step: int) -> float:
        return min(1.0, (step + 1) / 20) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / args.steps)))

    scheduler = LambdaLR(optimizer, warmup_cosine)

    # 4. resume: parameters, optimizer, scheduler, gossip state, step counter and RNG streams come back from this
    #    rank's checkpoint file; anything else with a state_dict() (a GradScaler, a torch.Generator, a dict of
    #    your own) goes into `extra` the same way. load_checkpoint is a collective, so every rank must take the
    #    same decision: the ranks count who finds its file, and if any does, all load (a rank whose file is
    #    missing then makes load_checkpoint raise its named error on every rank, instead of leaving them waiting).
    start = 0
    if args.checkpoint_dir:
        found = torch.tensor([float(gossip.checkpoint.checkpoint_path(args.checkpoint_dir, comm.rank).exists())])
        comm.all_reduce(found, "sum")
        if found.item() > 0:
            start = gossip.load_checkpoint(args.checkpoint_dir, model, optimizer, extra={"scheduler": scheduler})
    if comm.rank == 0:
        print(f"{comm.size} rank(s), starting at step {start} of {args.steps}", flush=True)

    # 5. train; the data loader resumes at the batch the checkpoint was taken after.
    steps_per_epoch = len(loader)
    batches = None
    for step in range(start, args.steps):
        if batches is None or step % steps_per_epoch == 0:
            sampler.set_epoch(step // steps_per_epoch)
            batches = iter(itertools.islice(loader, step % steps_per_epoch, None))
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()  # the wrapper mixes with the peers here, then the update is applied
        optimizer.zero_grad()
        scheduler.step()
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            validation = evaluate(model, validation_set, comm)  # on every rank: a collective
            if comm.rank == 0:
                print(f"step {done}: train loss {loss.item():.4f}, validation loss (averaged model) {validation!r}")
        if args.checkpoint_dir and (done % args.checkpoint_every == 0 or done == args.stop_at):
            gossip.save_checkpoint(args.checkpoint_dir, model, optimizer, extra={"scheduler": scheduler})
        if done == args.stop_at:
            break

    # 6. the result: the averaged model, through .module-style access to the plain nn.Module.
    with model.averaged() as averaged:  # a collective: every rank enters it
        if args.out and comm.rank == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            torch.save(averaged.state_dict(), Path(args.out) / "model.pt")

    # 7. close: flush the metrics and stop the exchanges, then leave the communicator.
    model.close()
    comm.close()


if __name__ == "__main__":
    main()
