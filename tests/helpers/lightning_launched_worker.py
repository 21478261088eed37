"""Worker for tests/test_integration_lightning.py under an outside launcher: torchrun, ``mpiexec`` or srun, Gloo, CPU.

Usage: ``torchrun --standalone --nproc-per-node N lightning_launched_worker.py OUT_DIR N``,
``mpiexec -n N python lightning_launched_worker.py OUT_DIR N``, or N processes with the variables ``srun`` gives its
tasks (tests/test_integration_lightning.py emulates them); on the unified ``lightning.pytorch`` package with
``GOSSIP_TEST_LIGHTNING=lightning.pytorch`` (:mod:`helpers.lightning_package`).

Unlike tests/helpers/lightning_worker.py, nothing here sets up torch.distributed: Lightning detects the launcher
(``TorchElasticEnvironment``, ``MPIEnvironment``, ``SLURMEnvironment``), creates the world process group and runs on
the processes it was given. Each rank writes ``rank<r>.pt``:

* ``environment``: the cluster environment's class, whether it created the processes itself, world size, global,
  local and node rank, the rendezvous port it chose, and torch.distributed's rank.
* ``package``: the Lightning package asked for, the one ``gossip.integrations.lightning`` chose, the modules of the
  Trainer and of the strategy's base class, and which of the two packages the process has imported.
* ``fit``: ``Trainer(strategy=GossipStrategy(), devices=N)`` of the default pipeline, 4 steps, validation on the
  replicas' average after steps 2 and 4 (the same data on every rank); the strategy's model, its DDP modules, the
  step events, the losses, the validation losses, this rank's replica at the end of training and its module after
  ``fit`` (the average).
* ``plain``: the same pipeline, seeds, data and steps in a plain loop (no Lightning).
* ``threads``: the gossip and Gloo threads after a ``validate`` (Lightning's world group up) and after ``fit``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from helpers.gloo_threads import gossip_and_gloo_threads
from helpers.lightning_package import PACKAGE, pl
from helpers.lightning_worker import Spy, dataset, flat, fresh, plain_loop, train_loader


class EndOfTraining(Spy):
    """:class:`Spy`, plus this rank's replica when training ends (before the strategy's teardown averages it)."""

    def __init__(self):
        super().__init__()
        self.replica: torch.Tensor | None = None

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self.replica = flat(pl_module)


def main() -> None:
    from gossip.integrations.lightning import LIGHTNING_PACKAGE, GossipStrategy  # after the Lightning package

    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    # every sample N times in a row: Lightning's DistributedSampler (rank r takes r, r + N, ...) gives every rank
    # the same validation data
    validation = DataLoader(TensorDataset(*(t.repeat_interleave(devices, 0) for t in dataset(seed=1).tensors)), 16)
    settings = {"accelerator": "cpu", "devices": devices, "logger": False, "enable_progress_bar": False,
                "enable_model_summary": False, "enable_checkpointing": False}  # fmt: skip

    module = fresh()
    trainer = pl.Trainer(strategy=GossipStrategy(), **settings)
    trainer.validate(module, validation, verbose=False)  # Lightning creates the world group: the threads' baseline
    cluster = trainer.strategy.cluster_environment
    environment = {
        "class": type(cluster).__name__,
        "external": cluster.creates_processes_externally,
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        "local_rank": cluster.local_rank(),
        "node_rank": cluster.node_rank(),
        "main_port": cluster.main_port,
        "dist_rank": dist.get_rank(),
    }
    package = {"asked": PACKAGE, "chosen": LIGHTNING_PACKAGE, "trainer": type(trainer).__module__,
               "strategy_base": GossipStrategy.__mro__[1].__module__, "loaded": sorted(
                   name for name in ("pytorch_lightning", "lightning.pytorch") if name in sys.modules)}  # fmt: skip
    result: dict = {"environment": environment, "package": package}
    baseline = gossip_and_gloo_threads()

    module = fresh()
    watcher = EndOfTraining()
    trainer = pl.Trainer(strategy=GossipStrategy(), callbacks=[watcher], max_steps=4, val_check_interval=2,
                         num_sanity_val_steps=0, **settings)  # fmt: skip
    trainer.fit(module, train_loader(), validation)
    result["fit"] = {"model_type": watcher.model_type, "ddp_modules": watcher.ddp_modules,
                     "gossip_steps": watcher.gossip_steps, "events": module.events, "losses": module.losses,
                     "val_losses": module.val_losses, "replica": watcher.replica, "final": flat(module)}  # fmt: skip
    result["threads"] = {"baseline": baseline, "after": gossip_and_gloo_threads(baseline)}
    result["plain"] = plain_loop(4)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
