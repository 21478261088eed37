"""Worker for tests/test_integration_gpu.py: Lightning's GossipStrategy and the HF GossipTrainer on one device.

Usage: ``python tests/helpers/device_integrations_worker.py DEVICE OUT`` with DEVICE ``cuda`` (or ``cpu``, to check the
tier without a GPU). One process, a world of one (one GPU cannot hold two NCCL ranks): each integration as its user
writes it for a GPU (``accelerator="gpu"``, ``bf16-mixed``; the Trainer's own device placement, ``bf16=True``)
trains a few steps with the default pipeline; the worker writes to OUT what each ran on: the device of the
parameters, the optimizer's class, gossip's backend, the first and last training losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 30


def lightning_run(device: str) -> dict:
    from gossip.integrations.lightning import GossipStrategy
    from helpers.lightning_package import pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
            self.losses: list[float] = []
            self.seen: dict = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            wrapper = self.trainer.strategy.wrapper
            self.seen = {"parameters": sorted({p.device.type for p in self.parameters()}),
                         "optimizer": type(self.trainer.optimizers[0]).__name__,
                         "backend": wrapper.comm.backend, "wrapper": type(wrapper).__name__}  # fmt: skip

        def configure_optimizers(self):  # as written for DDP
            return torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)

    pl.seed_everything(0, verbose=False)
    x = torch.randn(512, 16)
    data = DataLoader(TensorDataset(x, 0.5 * x[:, :4].sum(dim=1, keepdim=True)), batch_size=32, shuffle=True)
    module = Regression()
    trainer = pl.Trainer(strategy=GossipStrategy(), accelerator="gpu" if device == "cuda" else "cpu", devices=1,
                         precision="bf16-mixed", max_steps=STEPS, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, data)
    return {**module.seen, "losses": module.losses}


def hf_run(device: str, out: Path) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from gossip.integrations.hf import GossipTrainer

    seen: dict = {}

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            wrapper = trainer.model_wrapped
            seen.update(parameters=sorted({p.device.type for p in trainer.model.parameters()}),
                        optimizer=type(trainer._torch_optimizer()).__name__, backend=wrapper.comm.backend,
                        wrapper=type(wrapper).__name__)  # fmt: skip

    torch.manual_seed(0)
    rows = (torch.randint(0, 64, (256, 1)) + torch.randint(1, 4, (256, 1)) * torch.arange(16)) % 64
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    args = TrainingArguments(output_dir=str(out / "hf"), max_steps=STEPS, per_device_train_batch_size=16,
                             learning_rate=3e-3, bf16=True, use_cpu=device == "cpu", logging_steps=1,
                             save_strategy="no", report_to=[], disable_tqdm=True)  # fmt: skip
    trainer = GossipTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                            callbacks=[Spy()])  # fmt: skip
    trainer.train()
    return {**seen, "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}


def main() -> None:
    device, out = sys.argv[1], Path(sys.argv[2])
    results = {"lightning": lightning_run(device), "hf": hf_run(device, out.parent)}
    torch.save(results, out)


if __name__ == "__main__":
    main()
