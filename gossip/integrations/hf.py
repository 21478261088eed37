"""``GossipTrainer``: the HuggingFace ``transformers.Trainer`` with gossip instead of Accelerate's DDP.

Replace ``Trainer`` by ``GossipTrainer`` and launch as before (``torchrun --nproc-per-node N train.py``): each rank
trains its own replica with the default pipeline (:class:`gossip.Pipeline`: PowerGossip, sign momentum trackers and
``optim.MomentumTrackingAdamW`` with the ``TrainingArguments``' learning rate, Adam betas, epsilon and weight decay),
mixed with one peer per step; Accelerate still prepares the dataloaders (each rank its own shard) and the optimizer.

How it fits the Trainer:

* **The model.** The Trainer skips ``accelerator.prepare(model)`` when its ``_wrap_model`` returns a model other
  than ``trainer.model``; this one returns the gossip wrapper, built in ``create_optimizer`` (before the optimizer
  exists, as the wrapper needs) after ``accelerator.prepare_model(model, evaluation_mode=True)`` has applied the
  mixed-precision autocast and device placement without DDP. ``trainer.model`` stays the plain model, so the dataset
  columns are still filtered on its real ``forward``; ``trainer.model_wrapped`` is the wrapper while training.
* **The step** is the plain loop's: forward (x_t's exchange in flight), ``accelerator.backward``, gradient clipping,
  ``optimizer.step()`` (Accelerate's wrapper calls the torch optimizer's ``step(None)``: the mixing, then the
  update), the next exchange; gradient accumulation is one gossip step per optimizer step.
* **Evaluation and saving** during training (``evaluate()``, ``save_model()``, the checkpoints of ``save_strategy``)
  run on the replicas' average: a collective, as the Trainer already calls them on every rank. A checkpoint folder
  also holds each rank's own gossip state (``checkpoint-N/gossip/rank<r>.pt``, :func:`gossip.save_checkpoint`), which
  ``train(resume_from_checkpoint=...)`` restores.
* **The end of ``train()``**: every rank's model takes the replicas' average (as DDP's replicas end equal), the
  wrapper, its communicator and their process group are closed: ``evaluate()`` and ``save_model()`` afterwards see
  that one model, and no gossip thread is left.

Refused by name (:class:`gossip.errors.ConfigurationError`) until supported: ``fp16=True`` (its GradScaler),
DeepSpeed, FSDP, ``torch_compile``, several GPUs in one process (``DataParallel``), and an optimizer passed ready-made
(``optimizers=(opt, ...)``; pass ``optimizer_cls_and_kwargs`` instead, created after wrapping).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import optim
from gossip import checkpoint as gossip_checkpoint
from gossip.backends.bootstrap import DEFAULT_TIMEOUT
from gossip.errors import ConfigurationError, GossipWarning
from gossip.integrations.common import GossipGroup, Wrap, check_evaluate, choose_wrap, close_on_average
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.pipeline import Pipeline

try:
    import transformers
except ImportError as error:  # the optional dependency
    raise ImportError(
        "gossip.integrations.hf needs transformers: pip install 'gossip-train[hf]'", name=error.name
    ) from error

#: the folder inside a Trainer checkpoint that holds each rank's gossip state
STATE_DIR = "gossip"


def unsupported(args: Any) -> list[str]:
    """What of ``args`` the gossip trainer refuses, each with what to do instead.

    Args:
        args: the ``TrainingArguments`` (or None: the Trainer's defaults, all supported).

    Returns:
        One line per unsupported setting; empty when all are supported.
    """
    if args is None:
        return []
    found = []
    if getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False):
        found.append(
            "fp16=True: its GradScaler scales the loss in accelerator.backward while the gossip wrapper mixes "
            "unscaled parameters; use bf16=True (no scaler) or float32"
        )
    if getattr(args, "deepspeed", None):
        found.append("deepspeed: DeepSpeed's engine replaces the model and its all-reduce; drop the deepspeed config")
    if getattr(args, "fsdp", None):
        found.append("fsdp: FSDP shards the replica that gossip mixes whole; drop fsdp and fsdp_config")
    if getattr(args, "torch_compile", False):
        found.append("torch_compile=True: not supported with the gossip wrapper yet; compile the model yourself")
    return found


class GossipTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose model is wrapped by gossip (:class:`gossip.DecentralizedDataParallel`), not DDP.

    Takes the Trainer's arguments, plus the ``gossip_*`` ones below; the module docstring says what changes.

    Args:
        *args: ``transformers.Trainer``'s positional arguments (``model``, ``args``, ...).
        gossip_pipeline: the default pipeline's settings (None: ``gossip.Pipeline()``); its optimizer is the Trainer's
            unless ``optimizer_cls_and_kwargs`` is given.
        gossip_wrap: instead of the pipeline, ``wrap(module, comm)`` returning the wrapper; the optimizer is then the
            Trainer's own (``args.optim``, or ``optimizer_cls_and_kwargs``).
        gossip_wrapper_kwargs: further :class:`gossip.DecentralizedDataParallel` arguments for the pipeline.
        gossip_evaluate: ``"average"`` evaluates and saves the replicas' average during training (a collective);
            ``"local"`` evaluates each rank's own replica (saving still averages).
        gossip_backend: gossip's backend on its own process group (``"auto"``: NCCL on CUDA, else Gloo).
        gossip_timeout: seconds that bound every gossip wait.
        **kwargs: ``transformers.Trainer``'s keyword arguments.

    Raises:
        ConfigurationError: a setting listed by :func:`unsupported`, several GPUs in one process, or an optimizer
            passed ready-made, or DeepSpeed or FSDP enabled by Accelerate's configuration.
    """

    def __init__(
        self,
        *args: Any,
        gossip_pipeline: Pipeline | None = None,
        gossip_wrap: Wrap | None = None,
        gossip_wrapper_kwargs: dict[str, Any] | None = None,
        gossip_evaluate: str = "average",
        gossip_backend: str = "auto",
        gossip_timeout: float = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        refused = unsupported(training_args)
        if refused:
            raise ConfigurationError(
                f"rank {getattr(training_args, 'process_index', 0)}: GossipTrainer does not support "
                + "; ".join(refused)
            )
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers and optimizers[0] is not None:
            raise ConfigurationError(
                "GossipTrainer: an optimizer passed ready-made was created before the gossip wrapper; pass "
                "optimizer_cls_and_kwargs=(cls, kwargs) instead, and the trainer creates it after wrapping"
            )
        self._gossip_wrap = choose_wrap(gossip_pipeline, gossip_wrap, gossip_wrapper_kwargs, "GossipTrainer")
        self._gossip_pipeline = (gossip_pipeline or Pipeline()) if gossip_wrap is None else None
        self._gossip_evaluate = check_evaluate(gossip_evaluate, "GossipTrainer(gossip_evaluate=...)")
        self._gossip_backend, self._gossip_timeout = gossip_backend, gossip_timeout
        self._gossip_group: GossipGroup | None = None
        self._gossip_model: DecentralizedDataParallel | None = None
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ConfigurationError(
                f"rank {self.args.process_index}: GossipTrainer does not support "
                f"{'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'} (set in Accelerate's configuration): it "
                "replaces the replica that gossip mixes whole; launch without it"
            )
        if self.args.n_gpu > 1:
            raise ConfigurationError(
                f"rank {self.args.process_index}: GossipTrainer runs one replica per process, but this process sees "
                f"{self.args.n_gpu} GPUs (the Trainer would use DataParallel); launch one process per GPU (torchrun)"
            )

    @property
    def gossip_model(self) -> DecentralizedDataParallel | None:
        """The gossip wrapper while ``train()`` runs (open), else None."""
        model = self._gossip_model
        return model if model is not None and not model.closed else None

    def _gossip_wrapper(self) -> DecentralizedDataParallel:
        """The wrapper, built once per ``train()`` (a collective): Accelerate's autocast and placement, no DDP."""
        if self.gossip_model is None:
            prepared = self.accelerator.prepare_model(self.model, evaluation_mode=True)
            if prepared is not self.model:
                raise ConfigurationError(
                    f"rank {self.args.process_index}: Accelerate replaced the model while preparing it "
                    f"({type(prepared).__name__}); GossipTrainer needs the model itself"
                )
            self._gossip_group = GossipGroup(self._gossip_backend, self._gossip_timeout)
            self._gossip_model = self._gossip_wrap(self.model, self._gossip_group.comm)
        return self._gossip_model

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not training:
            return super()._wrap_model(model, training, dataloader)
        return self._gossip_wrapper()  # not self.model: the Trainer then skips accelerator.prepare(model)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Wrap the model (a collective), then create the optimizer over its parameters.

        Args:
            model: the Trainer's argument (unused: the optimizer covers the wrapped model's parameters).

        Returns:
            The pipeline's ``MomentumTrackingAdamW`` (with the ``TrainingArguments``' learning rate, betas, epsilon
                and weight decay), or the Trainer's own optimizer with ``gossip_wrap`` or ``optimizer_cls_and_kwargs``.
        """
        self._gossip_wrapper()
        if self.optimizer is None and self._gossip_pipeline is not None and self.optimizer_cls_and_kwargs is None:
            a = self.args
            groups = optim.param_groups(self.model, a.weight_decay)
            self.optimizer = self._gossip_pipeline.optimizer(
                groups, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), weight_decay=a.weight_decay,
                eps=a.adam_epsilon,
            )  # fmt: skip
            return self.optimizer
        return super().create_optimizer()

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's AcceleratedOptimizer holds it

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; at its end every rank's model takes the average and gossip is closed (a collective).

        After an exception nothing collective runs (a peer may be gone): the communicator alone is closed.

        Args:
            *args: ``Trainer.train``'s arguments (``resume_from_checkpoint``, ...).
            **kwargs: its keyword arguments.

        Returns:
            What ``Trainer.train`` returned.
        """
        try:
            output = super().train(*args, **kwargs)
        except BaseException:
            self._gossip_close(average=None)
            raise
        self._gossip_close(average=True)
        return output

    def _gossip_close(self, average: bool | None) -> None:
        wrapper, group = self.gossip_model, self._gossip_group
        self._gossip_model = self._gossip_group = None
        self.model_wrapped = self.model
        if group is None:
            return
        if wrapper is not None and average is not None:
            close_on_average(wrapper, group, average)
        else:
            group.close()

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate``, on the replicas' average while training (a collective: call it on every rank).

        Args:
            *args: ``Trainer.evaluate``'s arguments.
            **kwargs: its keyword arguments.

        Returns:
            The metrics, the same on every rank.
        """
        wrapper = self.gossip_model
        if wrapper is None or self._gossip_evaluate == "local":
            return super().evaluate(*args, **kwargs)
        with wrapper.averaged(buffers=True):
            return super().evaluate(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` of the replicas' average while training (a collective: call it on every rank).

        Args:
            output_dir: where to save (default ``args.output_dir``).
            _internal_call: the Trainer's own flag.
        """
        wrapper = self.gossip_model
        if wrapper is None:
            super().save_model(output_dir, _internal_call)
            return
        with wrapper.averaged(buffers=True):
            super().save_model(output_dir, _internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None:  # the parameters are views of the wrapper's flat buckets: save them as tensors alone
            state_dict = {name: value.detach().clone() for name, value in self.model.state_dict().items()}
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        wrapper = self.gossip_model
        if wrapper is not None:  # every rank's own state (a collective; the Trainer saves rank 0's optimizer)
            gossip_checkpoint.save_checkpoint(Path(output_dir) / STATE_DIR, wrapper, self._torch_optimizer())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        wrapper = self.gossip_model
        if checkpoint is None or wrapper is None:
            return
        folder = Path(checkpoint) / STATE_DIR
        if not os.path.isdir(folder):
            warnings.warn(
                f"rank {self.args.process_index}: {checkpoint} holds no per-rank gossip state (not written by "
                "GossipTrainer); every rank resumes from its saved weights and rank 0's optimizer state",
                GossipWarning,
                stacklevel=2,
            )
            return
        gossip_checkpoint.load_checkpoint(folder, wrapper, self._torch_optimizer())
