"""Worker for tests/test_integration_lightning.py: Lightning's Trainer with GossipStrategy on 4 CPU devices (Gloo).

Usage: python tests/helpers/lightning_worker.py OUT_DIR (4 processes with torchrun's environment, one per device).

One process per device runs every scenario in turn, each a ``Trainer.fit`` of the same small regression module
(seeded identically, so every scenario starts from the same weights), and writes ``rank<r>.pt``:

* ``pipeline``: the default pipeline with ``MomentumTrackingAdamW`` (which refuses a closure), 4 steps; the
  strategy's model, the step events (start, forward, backward, mix, update), the losses, the parameters.
* ``plain``: the same pipeline, seeds, data and steps in a plain loop (no Lightning): its events, losses, parameters.
* ``one_line``: the module returning ``torch.optim.AdamW`` (with the pipeline optimizer's hyper-parameters), the
  strategy the only change: the optimizer Lightning steps, losses, events, parameters; the same with an LR
  scheduler halving lr each step (the lr of each update); and with ``momentum_tracking=False``.
* ``manual``: ``pipeline`` with manual optimization; ``bf16``: ``pipeline`` under ``precision="bf16-mixed"`` (the
  outputs' and the parameters' dtypes).
* ``ring``: exact gossip on a ring, validation every 2 steps on the replicas' average (the same full validation set
  on every rank), the parameters just before each update.
* ``complete``: exact gossip on the complete graph (W = J): the mixed parameters just before each update.
* ``local``: ``ring`` with ``evaluate="local"`` and ``average_at_end=True``, then ``trainer.test`` and
  ``trainer.predict`` of the same Trainer on the validation data (the same on every rank): the validation losses,
  the parameters each validation ran on and those of the training step before it, the test metrics and the
  predictions, what the strategy held during test and predict, and the gossip threads then.
* ``refused``: two optimizers (manual optimization), ``LBFGS``, ``sync_batchnorm=True``, a GradScaler: the error
  every rank raises, and the threads after them.
* ``accumulate``: ``strategy="gossip"`` (the registered name) with ``accumulate_grad_batches=2``: the strategy's
  class, gossip steps, events.

Every scenario that validates during ``fit`` (``ring``, ``local``) records the wrapper's step count and the bytes
its communicator exchanged when each validation starts and ends.
* ``resume``: 8 steps (one batch per epoch) with a checkpoint at step 4, then ``fit(ckpt_path=...)`` from it.
* ``threads``: after each fit, the gossip and Gloo threads compared with those before the first.
"""

from __future__ import annotations

import collections
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gossip
import topologies
from gossip.errors import ConfigurationError
from gossip.integrations.common import GossipGroup
from helpers.gloo_threads import gossip_and_gloo_threads, thread_names
from helpers.lightning_package import pl

MixedPrecision = pl.plugins.precision.MixedPrecision

if TYPE_CHECKING:
    from gossip.integrations.lightning import GossipStrategy

N, BATCH, LR = 4, 4, 3e-2


def dataset(seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(64, 1, generator=generator))


class Regression(pl.LightningModule):
    """A small MLP; records its step events and losses. ``optimizer``: "pipeline", "sgd", "adamw" (torch's, with the
    pipeline optimizer's hyper-parameters) or "adamw-scheduled" (with an LR scheduler halving lr every step)."""

    def __init__(self, optimizer: str = "pipeline", manual: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = not manual
        self.optimizer_kind = optimizer
        self.events: list[str] = []
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.output_dtypes: set[str] = set()
        self.held: list[tuple[str, bool, list[str]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.events.append("forward")
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.output_dtypes.add(str(out.dtype))
        loss = F.mse_loss(out.float(), y)
        self.losses.append(loss.item())
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def on_after_backward(self) -> None:
        self.events.append("backward")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.mse_loss(self(x).float(), y).item())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.held.append(self._strategy_holds())
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        self.held.append(self._strategy_holds())
        return self(batch[0])

    def _strategy_holds(self) -> tuple[str, bool, list[str]]:
        """The strategy's model, whether it holds a gossip group, and this process's gossip threads."""
        strategy = self.trainer.strategy
        gossip_threads = sorted(name for name in thread_names() if name.startswith("gossip"))
        return type(strategy.model).__name__, strategy._group is not None, gossip_threads

    def configure_optimizers(self):
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=LR)
        if self.optimizer_kind.startswith("adamw"):  # what a LightningModule written for DDP returns
            adamw = torch.optim.AdamW(self.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
            if self.optimizer_kind == "adamw":
                return adamw
            halving = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
            return {"optimizer": adamw, "lr_scheduler": {"scheduler": halving, "interval": "step"}}
        return gossip.Pipeline().optimizer(self.parameters(), lr=LR)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def spy(wrapper: gossip.DecentralizedDataParallel, optimizer: torch.optim.Optimizer, module: Regression,
        snapshots: list[torch.Tensor]) -> None:  # fmt: skip
    """Record the algorithm's start and finish (the mixing) and the update (the optimizer's own pre-step hook runs
    after torch's global ones, i.e. after the mixing), with the parameters just before each update."""
    algorithm = wrapper.algorithm
    start, finish = algorithm.start, algorithm.finish

    def recording_start(step):
        module.events.append("start")
        return start(step)

    def recording_finish(pending):
        module.events.append("mix")
        return finish(pending)

    def before_update(*_):
        module.events.append("update")
        snapshots.append(flat(module))

    algorithm.start, algorithm.finish = recording_start, recording_finish
    optimizer.register_step_pre_hook(before_update)


class Spy(pl.Callback):
    def __init__(self):
        self.snapshots: list[torch.Tensor] = []
        self.gossip_steps = -1
        self.model_type = ""
        self.ddp_modules = -1
        self.saved: list[tuple[dict, torch.Tensor]] = []
        self.strategy_type = ""
        self.trained: torch.Tensor | None = None  # the parameters after the last training step
        self.validations: list[dict] = []
        self.optimizer_type = ""
        self.lrs: list[float] = []  # the learning rate of each update

    def on_fit_start(self, trainer, pl_module):
        model = trainer.strategy.model
        self.strategy_type = type(trainer.strategy).__name__
        self.optimizer_type = type(trainer.optimizers[0]).__name__
        trainer.optimizers[0].register_step_pre_hook(lambda opt, *_: self.lrs.append(opt.param_groups[0]["lr"]))
        self.model_type = type(model).__name__
        self.ddp_modules = sum(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules())
        spy(trainer.strategy.wrapper, trainer.optimizers[0], pl_module, self.snapshots)

    def on_train_end(self, trainer, pl_module):
        self.gossip_steps = trainer.strategy.wrapper.step_count

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trained = flat(pl_module)

    @staticmethod
    def _account(trainer) -> tuple[int, int, int]:
        wrapper = trainer.strategy.wrapper
        return wrapper.step_count, sum(wrapper.comm.bytes_sent.values()), sum(wrapper.comm.bytes_received.values())

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "fit":
            self.validations.append({"start": self._account(trainer), "trained": self.trained})

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.state.fn == "fit" and batch_idx == 0:
            self.validations[-1]["validated"] = flat(pl_module)

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit":
            self.validations[-1]["end"] = self._account(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        replica = torch.cat([v.reshape(-1).clone() for v in trainer.strategy.wrapper._replica_views])
        self.saved.append((torch.cat([v.reshape(-1) for v in checkpoint["state_dict"].values()]), replica))


class TwoOptimizers(Regression):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=LR), torch.optim.SGD(self.net[2].parameters(), lr=LR)]


class WithLBFGS(Regression):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=LR)


def refusal(module: Regression, **trainer) -> str:
    """The error ``fit`` raises, as ``"ConfigurationError: message"``, or ``"accepted"``."""
    from gossip.integrations.lightning import GossipStrategy

    pl.seed_everything(0, verbose=False)
    try:
        fit(module, GossipStrategy(), {"train_dataloaders": train_loader()}, **trainer)
    except ConfigurationError as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def ring_wrap(module, comm):
    return gossip.DecentralizedDataParallel(module, comm, topologies.ring(comm.size), gossip.ExactGossip())


def complete_wrap(module, comm):
    return gossip.DecentralizedDataParallel(module, comm, topologies.complete(comm.size), gossip.ExactGossip())


def fit(module: Regression, strategy: GossipStrategy | str, loaders: dict, ckpt_path=None, callbacks=(), devices=N,
        with_trainer=False, **trainer) -> Spy | tuple[Spy, pl.Trainer]:  # fmt: skip
    watcher = Spy()
    settings = {"max_steps": 4, "num_sanity_val_steps": 0, "enable_checkpointing": False, **trainer}
    run = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[watcher, *callbacks], **settings,
    )  # fmt: skip
    run.fit(module, ckpt_path=ckpt_path, **loaders)
    return (watcher, run) if with_trainer else watcher


def train_loader() -> DataLoader:
    return DataLoader(dataset(), batch_size=BATCH)  # Lightning shards and shuffles it (DistributedSampler, seed 0)


def fresh(**kwargs) -> Regression:
    pl.seed_everything(0, verbose=False)
    return Regression(**kwargs)


def plain_loop(steps: int) -> dict:
    """The pipeline scenario without Lightning: the README's loop over this rank's shard, the same seeds."""
    module = fresh()
    group = GossipGroup()
    model = gossip.Pipeline().wrap_module(module, group.comm)
    optimizer = gossip.Pipeline().optimizer(model.parameters(), lr=LR)
    snapshots: list[torch.Tensor] = []
    spy(model, optimizer, module, snapshots)
    sampler = DistributedSampler(dataset(), dist.get_world_size(), dist.get_rank(), shuffle=True, seed=0)  # Lightning's
    for step, (x, y) in enumerate(DataLoader(dataset(), batch_size=BATCH, sampler=sampler)):
        if step == steps:
            break
        loss = F.mse_loss(model(x), y)
        module.losses.append(loss.item())
        loss.backward()
        module.events.append("backward")
        optimizer.step()
        optimizer.zero_grad()
    model.close()
    group.close()
    return {"events": module.events, "losses": module.losses, "final": flat(module)}


def main() -> None:
    from gossip.integrations.lightning import GossipStrategy  # after the Lightning package it builds on

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")  # Lightning adopts it; its threads, once all started, are the baseline
    rank = dist.get_rank()
    dist.all_reduce(torch.zeros(1))
    dist.barrier()
    time.sleep(0.5)
    baseline = gossip_and_gloo_threads()
    threads: dict[str, collections.Counter] = {}
    result: dict = {}

    module = fresh()
    watcher = fit(module, GossipStrategy(average_at_end=False), {"train_dataloaders": train_loader()})
    result["pipeline"] = {"model_type": watcher.model_type, "ddp_modules": watcher.ddp_modules,
                          "events": module.events, "losses": module.losses, "final": flat(module),
                          "gossip_steps": watcher.gossip_steps}  # fmt: skip
    threads["pipeline"] = gossip_and_gloo_threads(baseline)
    result["plain"] = plain_loop(4)

    one_line = {}  # a module written for DDP, the strategy the only change
    for kind, strategy in (("adamw", GossipStrategy(average_at_end=False)),
                           ("adamw-scheduled", GossipStrategy(average_at_end=False)),
                           ("kept", GossipStrategy(average_at_end=False, momentum_tracking=False))):  # fmt: skip
        module = fresh(optimizer="adamw" if kind == "kept" else kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watcher = fit(module, strategy, {"train_dataloaders": train_loader()})
        one_line[kind] = {"optimizer": watcher.optimizer_type, "losses": module.losses, "final": flat(module),
                          "events": module.events, "lrs": watcher.lrs,
                          "warnings": [str(w.message) for w in caught if "optimizer" in str(w.message)]}  # fmt: skip
    result["one_line"] = one_line

    module = fresh(manual=True)
    fit(module, GossipStrategy(average_at_end=False), {"train_dataloaders": train_loader()})
    result["manual"] = {"losses": module.losses, "events": module.events}

    module = fresh()
    fit(module, GossipStrategy(), {"train_dataloaders": train_loader()}, precision="bf16-mixed")
    result["bf16"] = {"losses": module.losses, "dtypes": sorted(module.output_dtypes),
                      "parameters": sorted({str(p.dtype) for p in module.parameters()})}  # fmt: skip

    module = fresh(optimizer="sgd")
    shard = DataLoader(Subset(dataset(), range(rank, 64, N)), batch_size=BATCH)
    validation = DataLoader(dataset(seed=1), batch_size=16)
    watcher = fit(module, GossipStrategy(wrap=ring_wrap, average_at_end=False),
                  {"train_dataloaders": shard, "val_dataloaders": validation},
                  use_distributed_sampler=False, val_check_interval=2)  # fmt: skip
    result["ring"] = {"pre_update": watcher.snapshots, "val_losses": module.val_losses, "final": flat(module),
                      "validations": watcher.validations}  # fmt: skip
    threads["ring"] = gossip_and_gloo_threads(baseline)

    module = fresh(optimizer="sgd")
    watcher, trainer = fit(module, GossipStrategy(wrap=ring_wrap, evaluate="local"),
                           {"train_dataloaders": shard, "val_dataloaders": validation}, use_distributed_sampler=False,
                           val_check_interval=2, with_trainer=True)  # fmt: skip
    tested = trainer.test(module, validation, verbose=False)
    predicted = torch.cat(trainer.predict(module, validation))
    result["local"] = {"val_losses": module.val_losses, "validations": watcher.validations, "tested": tested,
                       "predicted": predicted, "held": module.held, "final": flat(module)}  # fmt: skip
    threads["local"] = gossip_and_gloo_threads(baseline)

    module = fresh(optimizer="sgd")
    watcher = fit(module, GossipStrategy(wrap=complete_wrap, average_at_end=False),
                  {"train_dataloaders": train_loader()}, max_steps=2)  # fmt: skip
    result["complete"] = {"pre_update": watcher.snapshots}

    result["refused"] = {
        "two optimizers": refusal(TwoOptimizers(manual=True)),
        "LBFGS": refusal(WithLBFGS()),
        "sync_batchnorm": refusal(Regression(), sync_batchnorm=True),
        # what precision="16-mixed" builds on a GPU (on the CPU Lightning turns it into bf16-mixed, no scaler)
        "GradScaler": refusal(Regression(), plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]),
    }
    threads["refused"] = gossip_and_gloo_threads(baseline)

    module = fresh()
    watcher = fit(module, "gossip", {"train_dataloaders": train_loader()}, max_steps=2, accumulate_grad_batches=2)
    result["accumulate"] = {"gossip_steps": watcher.gossip_steps, "events": module.events,
                            "strategy": watcher.strategy_type}  # fmt: skip

    # One batch per epoch on each rank, never shuffled: the data of a step depends on nothing that a resume from an
    # epoch's end could change in Lightning's loops (its data order on resume is the same as with DDP).
    ckpt_dir = out / "checkpoints"
    own = {
        "train_dataloaders": DataLoader(Subset(dataset(), range(rank * BATCH, (rank + 1) * BATCH)), batch_size=BATCH)
    }
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, every_n_epochs=4, save_top_k=-1, save_on_train_epoch_end=True
    )
    module = fresh()
    watcher = fit(module, GossipStrategy(average_at_end=False), own, max_steps=8, callbacks=[checkpoint],
                  enable_checkpointing=True, use_distributed_sampler=False)  # fmt: skip
    straight, saved, straight_losses = flat(module), watcher.saved, module.losses
    module = fresh()
    fit(module, GossipStrategy(average_at_end=False), own, max_steps=8, use_distributed_sampler=False,
        ckpt_path=str(ckpt_dir / "epoch=3-step=4.ckpt"))  # fmt: skip
    result["resume"] = {"straight": straight, "resumed": flat(module), "saved": saved,
                        "straight_losses": straight_losses, "resumed_losses": module.losses,
                        "files": sorted(p.name for p in ckpt_dir.iterdir())}  # fmt: skip
    threads["resume"] = gossip_and_gloo_threads(baseline)
    result["threads"] = {"baseline": baseline, "after": threads}

    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
