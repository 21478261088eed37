"""PyTorch Lightning with gossip instead of DDP: the Trainer's ``strategy`` is the one line that changes.

A small regression model on synthetic data, trained by every process on its own shard with the default pipeline
(PowerGossip, sign momentum trackers, ``optim.MomentumTrackingAdamW``), validated on the replicas' average:

    python examples/lightning_gossip.py --devices 4           # Lightning starts the 4 processes (CPU: Gloo)
    torchrun --nproc-per-node 4 examples/lightning_gossip.py --devices 4
    mpiexec -n 4 python examples/lightning_gossip.py --devices 4  # Lightning's MPIEnvironment: needs mpi4py

On GPUs, ``--accelerator gpu`` (gossip then runs on NCCL). Rank 0 prints the validation loss of the averaged
model before and after training. Needs ``pip install 'gossip-train[lightning]'``; with the unified ``lightning``
package, ``import lightning.pytorch as pl`` in place of ``import pytorch_lightning as pl`` is the only change.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gossip.integrations.lightning import GossipStrategy


class Regression(pl.LightningModule):
    """An MLP regressing a smooth function of its inputs."""

    def __init__(self, lr: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        # as written for DDP: GossipStrategy makes this AdamW the pipeline's optim.MomentumTrackingAdamW
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    return TensorDataset(x, torch.sin(x[:, :4].sum(dim=1, keepdim=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    model = Regression(args.lr)
    train = DataLoader(data(1024, 0), batch_size=32, shuffle=True)
    validation = DataLoader(data(256, 1), batch_size=64)
    trainer = pl.Trainer(
        strategy=GossipStrategy(),  # was "ddp"
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = trainer.validate(model, validation, verbose=False)[0]["val_loss"]
    trainer.fit(model, train, validation)
    after = trainer.validate(model, validation, verbose=False)[0]["val_loss"]  # every rank holds the average now
    if trainer.is_global_zero:
        steps = trainer.global_step
        print(f"{trainer.world_size} processes, {steps} steps: validation loss {before:.4f} -> {after:.4f}")


if __name__ == "__main__":
    main()
