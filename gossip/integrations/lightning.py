"""``GossipStrategy``: PyTorch Lightning trains a LightningModule with gossip instead of DDP.

``Trainer(strategy=GossipStrategy(), accelerator="cpu", devices=4)`` (or ``strategy="gossip"`` once this module is
imported) wraps the LightningModule with the default pipeline's :class:`gossip.DecentralizedDataParallel`: no DDP,
no collective of gossip's during training. Launchers, data sharding, logging and callbacks stay Lightning's.

* **The plain loop's step order.** Lightning runs ``training_step`` and ``backward`` in a closure passed to
  ``optimizer.step(closure)``, and torch's pre-step hooks (where the wrapper mixes) fire before a closure runs. The
  precision plugin gets an optimizer whose ``step(closure)`` runs the closure, then the real ``step()`` without
  one: the exchange started after the previous update overlaps forward and backward, then the mixing, the update.
  So momentum-tracking optimizers (which refuse a closure) and manual optimization work too.
* **Gossip has a process group of its own**; Lightning's ``reduce``, ``barrier`` and ``broadcast`` keep the world.
* **Validation, test and predict call the LightningModule directly**, never the wrapper (whose forward starts an
  exchange); with ``evaluate="average"`` validation during ``fit`` runs on the replicas' average.
* **Checkpoints** during fit hold the averaged weights (a collective; Lightning calls it on every rank), and each
  rank's own state goes to ``path.ckpt.gossip/rank<r>.pt`` (:func:`gossip.save_checkpoint`), which
  ``trainer.fit(ckpt_path=path.ckpt)`` restores: the resumed run continues bit for bit.
* **Teardown** averages the replicas into every rank's module (``average_at_end``), closes the wrapper, the
  communicator and its group: no thread of the run is left, and after ``fit`` every rank holds one model.

Refused by name: several optimizers, ``LBFGS``, ``sync_batchnorm=True``, a GradScaler (``precision="16-mixed"``).

Built on one Lightning package, :data:`LIGHTNING_PACKAGE`, chosen when this module is imported: the unified
``lightning.pytorch`` when it is imported already and ``pytorch_lightning`` is not (``import lightning.pytorch as
pl`` before ``from gossip.integrations.lightning import GossipStrategy``), or when ``pytorch_lightning`` is not
installed; else ``pytorch_lightning`` (the ``[lightning]`` extra). The two packages' Trainers accept only their own
package's strategies.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import shutil
import sys
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gossip import checkpoint as gossip_checkpoint
from gossip.backends.bootstrap import DEFAULT_TIMEOUT
from gossip.errors import ConfigurationError, GossipWarning
from gossip.integrations.common import GossipGroup, Wrap, check_evaluate, choose_wrap, close_on_average
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.pipeline import Pipeline


def _lightning_package() -> str:
    """The package whose Trainer the strategy is for: ``lightning.pytorch`` when it is imported already and
    ``pytorch_lightning`` is not, or when ``pytorch_lightning`` is not installed; else ``pytorch_lightning``."""
    unified = "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules
    if unified or importlib.util.find_spec("pytorch_lightning") is None:
        return "lightning.pytorch"
    return "pytorch_lightning"


#: ``"pytorch_lightning"`` or ``"lightning.pytorch"``: the package whose classes :class:`GossipStrategy` builds on
LIGHTNING_PACKAGE = _lightning_package()
_FABRIC = "lightning.fabric" if LIGHTNING_PACKAGE == "lightning.pytorch" else "lightning_fabric"

try:
    pl = importlib.import_module(LIGHTNING_PACKAGE)
    default_pg_timeout = importlib.import_module(f"{_FABRIC}.plugins.collectives.torch_collective").default_pg_timeout
    DDPStrategy = importlib.import_module(f"{LIGHTNING_PACKAGE}.strategies").DDPStrategy
    StrategyRegistry = importlib.import_module(f"{LIGHTNING_PACKAGE}.strategies").StrategyRegistry
    TrainerFn = importlib.import_module(f"{LIGHTNING_PACKAGE}.trainer.states").TrainerFn
except ImportError as error:  # the optional dependency
    raise ImportError(
        "gossip.integrations.lightning needs pytorch_lightning (or the unified lightning package): "
        "pip install 'gossip-train[lightning]'",
        name=error.name,
    ) from error

#: the suffix of the folder that holds each rank's state beside a Lightning checkpoint file
STATE_SUFFIX = ".gossip"


def state_dir(filepath: str | Path) -> Path:
    """The folder of the per-rank gossip state that belongs to the Lightning checkpoint ``filepath``.

    Args:
        filepath: the ``.ckpt`` file.

    Returns:
        ``filepath`` with :data:`STATE_SUFFIX` appended (``last.ckpt`` -> ``last.ckpt.gossip``).
    """
    return Path(f"{filepath}{STATE_SUFFIX}")


class _ClosureFirst:
    """The optimizer as the precision plugin sees it: ``step(closure)`` runs the closure (training step, backward,
    gradient clipping, ``on_before_optimizer_step``), then the real ``step()`` without a closure, so that the
    wrapper's pre-step hook mixes after the backward, as in the plain loop. Everything else is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self._optimizer.step(**kwargs)
        return result


def adopt_adam(optimizer: torch.optim.Optimizer, pipeline: Pipeline, schedulers: list[Any] = ()) -> Any:
    """The pipeline's :class:`optim.MomentumTrackingAdamW` in place of a fresh AdamW (or weight-decay-free Adam).

    The new optimizer takes over the same param-group dicts (learning rates, betas, eps, decoupled weight decay and
    anything a scheduler keeps there), so an LR scheduler built on ``optimizer`` steps it once re-pointed, which this
    does for ``schedulers`` (Lightning's ``LRSchedulerConfig`` list). Adam's ``weight_decay`` is an L2 term, not
    AdamW's decoupled decay, and AMSGrad, ``maximize`` and capturable or fused kernels have no counterpart: such an
    optimizer is kept, with a :class:`~gossip.errors.GossipWarning` saying why. Any other optimizer is returned as is.

    Args:
        optimizer: what ``configure_optimizers`` returned, before its first step.
        pipeline: the pipeline whose optimizer settings (its ``second_moment``) the new optimizer takes.
        schedulers: Lightning's scheduler configs (``.scheduler.optimizer`` is re-pointed where it is ``optimizer``).

    Returns:
        The new optimizer, or ``optimizer``.
    """
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam) or optimizer.state:
        return optimizer
    groups = optimizer.param_groups
    unsupported = {key for group in groups for key in ("amsgrad", "maximize", "capturable", "fused") if group.get(key)}
    if type(optimizer) is torch.optim.Adam and any(group["weight_decay"] for group in groups):
        unsupported.add("weight_decay (Adam's L2 term)")
    if unsupported:
        warnings.warn(
            f"GossipStrategy: {type(optimizer).__name__} with {', '.join(sorted(unsupported))} has no "
            "momentum-tracking counterpart, so it trains as returned, with the pipeline's trackers but not its "
            "optimizer; return torch.optim.AdamW without them (or gossip.Pipeline().optimizer(...)) for the "
            "default pipeline",
            GossipWarning,
            stacklevel=2,
        )
        return optimizer
    first = groups[0]
    adopted = pipeline.optimizer(groups, first["lr"], first["betas"], first["weight_decay"], first["eps"])
    repointed = False
    for config in schedulers:
        if getattr(config.scheduler, "optimizer", None) is optimizer:
            config.scheduler.optimizer, repointed = adopted, True
    if repointed:
        _count_steps_for_schedulers(adopted)
    return adopted


def _count_steps_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer``'s steps as torch's LR schedulers do on the optimizer they are built on (``_opt_called``),
    so that a re-pointed scheduler sees its steps and does not warn that the optimizer was replaced."""
    owner, step = weakref.ref(optimizer), type(optimizer).step  # no reference cycle through the bound method

    @functools.wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        stepped = owner()
        stepped._opt_called = True
        return step(stepped, *args, **kwargs)

    counted._wrapped_by_lr_sched = True
    optimizer.step = counted


class GossipStrategy(DDPStrategy):
    """Lightning's strategy for gossip data parallelism: one replica per process, mixed with its peers, no DDP.

    ``Trainer(strategy=GossipStrategy(), accelerator=..., devices=N)``; the module docstring says what changes from
    DDP. The LightningModule's ``configure_optimizers`` returns one optimizer over ``self.parameters()`` (it is
    created after wrapping); a ``torch.optim.AdamW`` becomes the default pipeline's ``optim.MomentumTrackingAdamW``
    (``momentum_tracking``), so a module written for DDP trains the whole pipeline, and any other ``torch.optim``
    optimizer works as returned.

    Args:
        pipeline: the default pipeline's settings (None: ``gossip.Pipeline()``).
        wrap: instead of the pipeline, ``wrap(module, comm)`` returning the wrapper, e.g.
            ``lambda m, c: gossip.DecentralizedDataParallel(m, c, topologies.ring(c.size), gossip.ExactGossip())``
            (with ``start_method="spawn"`` it must pickle: a module-level function).
        wrapper_kwargs: further :class:`gossip.DecentralizedDataParallel` arguments for the pipeline (``run_dir``,
            ``seed``, ...).
        evaluate: ``"average"`` validates on the replicas' average during ``fit`` (a collective, as Lightning's
            validation already runs on every rank); ``"local"`` on each rank's own replica.
        average_at_end: at the end of ``fit`` every rank's LightningModule takes the replicas' average.
        gossip_backend: gossip's backend on its own process group (``"auto"``: NCCL on CUDA, else Gloo).
        gossip_timeout: seconds that bound every gossip wait.
        accelerator: as for ``DDPStrategy`` (the Trainer usually sets it).
        parallel_devices: as for ``DDPStrategy``.
        cluster_environment: as for ``DDPStrategy``.
        checkpoint_io: as for ``DDPStrategy``.
        precision_plugin: as for ``DDPStrategy``.
        process_group_backend: the world process group's backend, as for ``DDPStrategy``.
        timeout: the world process group's timeout, as for ``DDPStrategy``.
        start_method: ``"popen"`` (the script is run again per device), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        momentum_tracking: with the pipeline (no ``wrap``), a ``torch.optim.AdamW`` (or an ``Adam`` without weight
            decay) returned by ``configure_optimizers`` becomes the pipeline's ``optim.MomentumTrackingAdamW`` over
            the same param groups and hyper-parameters, its LR schedulers included (:func:`adopt_adam`); False
            keeps the optimizer as returned.
    """

    strategy_name = "gossip"

    def __init__(
        self,
        pipeline: Pipeline | None = None,
        *,
        wrap: Wrap | None = None,
        wrapper_kwargs: dict[str, Any] | None = None,
        evaluate: str = "average",
        average_at_end: bool = True,
        gossip_backend: str = "auto",
        gossip_timeout: float = DEFAULT_TIMEOUT,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        momentum_tracking: bool = True,
    ):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._wrap = choose_wrap(pipeline, wrap, wrapper_kwargs, "GossipStrategy")
        # the pipeline whose optimizer an Adam(W) becomes; None when wrap builds the wrapper or the user opts out
        self._adopt = (Pipeline() if pipeline is None else pipeline) if wrap is None and momentum_tracking else None
        self._evaluate = check_evaluate(evaluate, "GossipStrategy(evaluate=...)")
        self._average_at_end = bool(average_at_end)
        self._gossip_backend, self._gossip_timeout = gossip_backend, gossip_timeout
        self._group: GossipGroup | None = None
        self._evaluation: contextlib.ExitStack | None = None  # the averaged() block of a validation run
        self._resumed_from: Path | None = None
        self._failed = False

    @property
    def wrapper(self) -> DecentralizedDataParallel | None:
        """The gossip wrapper around the LightningModule while fitting, else None."""
        return self.model if isinstance(self.model, DecentralizedDataParallel) else None

    def _where(self) -> str:
        wrapper = self.wrapper
        step = f": step {wrapper.step_count}" if wrapper is not None else ""
        return f"rank {self.global_rank}{step}: GossipStrategy"

    # -- setting up ---------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's DDP set-up with the gossip wrapper in DDP's place, then the optimizer checks.

        Args:
            trainer: the Trainer.

        Raises:
            ConfigurationError: ``sync_batchnorm=True``, a GradScaler (``precision="16-mixed"`` on GPUs), several
                optimizers, or ``LBFGS``.
        """
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:
            raise ConfigurationError(
                f"{self._where()}: Trainer(sync_batchnorm=True) all-reduces the batch statistics in every forward, "
                "a collective inside the step that gossip exists to avoid; drop sync_batchnorm (the BatchNorm "
                "buffers stay per rank, or pass wrapper_kwargs={'buffers': 'average'})"
            )
        if fitting and getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigurationError(
                f"{self._where()}: precision='16-mixed' steps through a GradScaler, which skips the optimizer step "
                "on a rank whose gradients overflow while its peers step, and gossip's ranks must step together; "
                "use precision='bf16-mixed' (no loss scaling) or '32-true'"
            )
        self._failed = False
        super().setup(trainer)
        if fitting:
            self._check_optimizers()

    def configure_ddp(self) -> None:
        """Wrap the LightningModule with gossip (DDPStrategy's hook for wrapping; a collective).

        The communicator runs on a new process group of Lightning's world (:class:`GossipGroup`).
        """
        self._group = GossipGroup(self._gossip_backend, self._gossip_timeout)
        self.model = self._wrap(self.model, self._group.comm)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's ``configure_optimizers``; then an Adam(W) becomes the pipeline's (``momentum_tracking``).

        Args:
            trainer: the Trainer.
        """
        super().setup_optimizers(trainer)
        if self._adopt is not None and len(self.optimizers) == 1:
            adopted = adopt_adam(self.optimizers[0], self._adopt, self.lr_scheduler_configs)
            if adopted is not self.optimizers[0]:
                self.optimizers = [adopted]

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise ConfigurationError(
                f"{self._where()}: configure_optimizers returned {len(self.optimizers)} optimizers; the gossip "
                "wrapper mixes once per step of one optimizer over all the module's parameters: return one"
            )
        if isinstance(self.optimizers[0], torch.optim.LBFGS):
            raise ConfigurationError(
                f"{self._where()}: LBFGS evaluates its closure several times per step, and the mixing happens once "
                "before the step; use an optimizer that steps on the gradients of one backward"
            )

    # -- the training step --------------------------------------------------------------------------------------
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward and backward), then the optimizer's step without it: mixing, then the update.

        Args:
            optimizer: the optimizer (Lightning's ``LightningOptimizer.step`` passes the torch one).
            closure: Lightning's closure: zero_grad, ``training_step``, backward (a no-op in manual optimization).
            model: the LightningModule (default: this strategy's).
            **kwargs: further ``optimizer.step`` arguments.

        Returns:
            What the closure returned (the loss).
        """
        return super().optimizer_step(_ClosureFirst(optimizer), closure, model, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step``, called directly: the wrapper's forward would start an exchange.

        Args:
            *args: Lightning's arguments of the step.
            **kwargs: its keyword arguments.

        Returns:
            What ``validation_step`` returned.
        """
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``test_step``, called directly.

        Args:
            *args: Lightning's arguments of the step.
            **kwargs: its keyword arguments.

        Returns:
            What ``test_step`` returned.
        """
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``predict_step``, called directly.

        Args:
            *args: Lightning's arguments of the step.
            **kwargs: its keyword arguments.

        Returns:
            What ``predict_step`` returned.
        """
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # -- evaluation on the average ------------------------------------------------------------------------------
    def on_validation_start(self) -> None:
        """With ``evaluate="average"`` while fitting, let the module hold the replicas' average (a collective)."""
        super().on_validation_start()
        wrapper = self.wrapper
        if self._evaluate == "average" and wrapper is not None and self._evaluation is None:
            self._evaluation = contextlib.ExitStack()
            self._evaluation.enter_context(wrapper.averaged(buffers=True))

    def on_validation_end(self) -> None:
        """Give each rank its own replica back after an averaged validation."""
        self._end_evaluation()
        super().on_validation_end()

    def _end_evaluation(self) -> None:
        if self._evaluation is not None:
            stack, self._evaluation = self._evaluation, None
            stack.close()

    # -- checkpoints --------------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The weights a Lightning checkpoint holds: while fitting, the replicas' average (a collective).

        Returns:
            The LightningModule's state dict (averaged while fitting; inside an averaged validation it already is).
        """
        wrapper = self.wrapper
        if wrapper is None or wrapper.closed or self._evaluation is not None:
            return super().lightning_module_state_dict()
        with wrapper.averaged(buffers=True) as average:
            return {name: value.detach().clone() for name, value in average.state_dict().items()}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write each rank's gossip state beside ``filepath`` (a collective), then Lightning's file (rank 0).

        Args:
            checkpoint: what Lightning dumped (the averaged weights, loops, schedulers, rank 0's optimizer).
            filepath: the ``.ckpt`` file (a local path).
            storage_options: passed to the checkpoint IO plugin.
        """
        wrapper = self.wrapper
        if wrapper is not None and not wrapper.closed:
            folder = state_dir(filepath)
            gossip_checkpoint.save_checkpoint(folder, wrapper, self.optimizers[0])
            checkpoint["gossip"] = {"state": folder.name, "world_size": wrapper.comm.size}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a Lightning checkpoint and, on every rank, that rank's gossip state beside it.

        Args:
            filepath: the ``.ckpt`` file.
        """
        super().remove_checkpoint(filepath)
        folder = state_dir(filepath)
        gossip_checkpoint.checkpoint_path(folder, self.global_rank).unlink(missing_ok=True)
        if self.is_global_zero:
            shutil.rmtree(folder, ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a Lightning checkpoint, remembering where it is (its gossip state lies beside it).

        Args:
            checkpoint_path: the ``.ckpt`` file.
            weights_only: passed to Lightning.

        Returns:
            The checkpoint.
        """
        self._resumed_from = Path(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore the optimizer, then this rank's own gossip state when the checkpoint has one (a collective).

        Args:
            checkpoint: the Lightning checkpoint being resumed.
        """
        super().load_optimizer_state_dict(checkpoint)
        wrapper, saved = self.wrapper, checkpoint.get("gossip")
        if wrapper is None:
            return
        if saved is None or self._resumed_from is None:
            warnings.warn(
                f"{self._where()}: the checkpoint holds no per-rank gossip state (it was not written by "
                "GossipStrategy); every rank resumes from its averaged weights and rank 0's optimizer state",
                GossipWarning,
                stacklevel=2,
            )
            return
        gossip_checkpoint.load_checkpoint(self._resumed_from.parent / saved["state"], wrapper, self.optimizers[0])

    # -- the end ------------------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """After an exception, teardown only closes: no collective, since a peer may be gone.

        Args:
            exception: what interrupted the run.
        """
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """End the run: the average into every rank's module (``average_at_end``), then close wrapper and group."""
        self._end_evaluation()
        wrapper = self.wrapper
        if wrapper is not None:
            self.model = self.lightning_module
        if self._group is not None:
            group, self._group = self._group, None
            if wrapper is not None and not self._failed:
                close_on_average(wrapper, group, self._average_at_end)
            else:
                group.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Make ``Trainer(strategy="gossip")`` this strategy with its defaults.

        Args:
            strategy_registry: Lightning's ``StrategyRegistry``.
        """
        strategy_registry.register(
            cls.strategy_name, cls, description="gossip data parallelism (gossip-train): no DDP", override=True
        )


GossipStrategy.register_strategies(StrategyRegistry)
