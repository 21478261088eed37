"""What the Lightning strategy and the HuggingFace Trainer share: gossip's communicator on a process group of its own,
the choice of wrapper, and the end of a run on the average.

A framework keeps the world process group for its own collectives (Lightning's ``reduce`` and ``barrier`` behind
``self.log(..., sync_dist=True)``, the HF Trainer's gathered losses and metrics); gossip's communicator moves its
messages from a thread of its own, so it gets a group of its own (:class:`GossipGroup`) and the two never interleave
operations on one group.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from gossip.backends.base import Communicator
from gossip.backends.bootstrap import DEFAULT_TIMEOUT, init
from gossip.errors import ArgumentTypeError, InvalidArgumentError
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.pipeline import Pipeline

#: How a framework's evaluation sees the replicas: on their average (a collective), or each rank on its own.
EVALUATE = ("average", "local")

#: What wraps the framework's module: ``wrap(module, comm)`` returns the wrapper (a collective, as its constructor).
Wrap = Callable[[nn.Module, Communicator], DecentralizedDataParallel]


def check_evaluate(evaluate: str, where: str) -> str:
    """Refuse an ``evaluate`` setting other than :data:`EVALUATE`.

    Args:
        evaluate: the setting.
        where: the argument's name, for the message (``"GossipStrategy(evaluate=...)"``).

    Returns:
        ``evaluate``.

    Raises:
        InvalidArgumentError: it is not one of :data:`EVALUATE`.
    """
    if evaluate not in EVALUATE:
        raise InvalidArgumentError(f"{where} must be one of {EVALUATE}, got {evaluate!r}")
    return evaluate


def _wrap_with(pipeline: Pipeline, wrapper: dict[str, Any], module: nn.Module, comm: Communicator) -> Any:
    return pipeline.wrap_module(module, comm, **wrapper)


def choose_wrap(
    pipeline: Pipeline | None, wrap: Wrap | None, wrapper_kwargs: dict[str, Any] | None, where: str
) -> Wrap:
    """The function that wraps the framework's module: the pipeline's (default ``Pipeline()``), or ``wrap``.

    The result pickles when ``wrap`` does (Lightning's ``spawn`` start method sends the strategy to its workers).

    Args:
        pipeline: the default pipeline's settings, or None for ``Pipeline()``.
        wrap: ``wrap(module, comm)`` returning a :class:`gossip.DecentralizedDataParallel`, instead of the pipeline.
        wrapper_kwargs: further wrapper arguments for the pipeline (``run_dir``, ``seed``, ...).
        where: the caller's name, for the messages.

    Returns:
        ``wrap(module, comm)``.

    Raises:
        InvalidArgumentError: both ``pipeline`` and ``wrap`` are given, or ``wrapper_kwargs`` with ``wrap``.
        ArgumentTypeError: ``wrap`` is not callable, or ``pipeline`` is not a :class:`gossip.Pipeline`.
    """
    if wrap is not None:
        if pipeline is not None or wrapper_kwargs:
            raise InvalidArgumentError(
                f"{where}: pass either a pipeline (with its wrapper_kwargs) or wrap(module, comm), not both; wrap "
                "builds the whole wrapper itself"
            )
        if not callable(wrap):
            raise ArgumentTypeError(f"{where}: wrap must be callable as wrap(module, comm), got {type(wrap).__name__}")
        return wrap
    chosen = Pipeline() if pipeline is None else pipeline
    if not isinstance(chosen, Pipeline):
        raise ArgumentTypeError(f"{where}: pipeline must be a gossip.Pipeline, got {type(chosen).__name__}")
    return functools.partial(_wrap_with, chosen, dict(wrapper_kwargs or {}))


class GossipGroup:
    """Gossip's communicator for a framework's run, on a new process group of the framework's world.

    A collective: every rank creates it at the same point. Without torch.distributed initialised (one process, no
    launcher) it is ``gossip.init()``'s world of one. :meth:`close` closes the communicator and destroys the group,
    so that no thread of either outlives the run.

    Args:
        backend: gossip's backend on the group: ``"auto"`` (NCCL on a CUDA group, else Gloo), ``"gloo"`` or
            ``"nccl"``.
        timeout: seconds that bound every wait of the communicator.
    """

    def __init__(self, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT):
        self.group = dist.new_group() if dist.is_available() and dist.is_initialized() else None
        self.comm: Communicator = (
            init(backend, timeout, group=self.group) if self.group is not None else init(backend, timeout)
        )

    def close(self) -> None:
        """Close the communicator, then destroy the group (a second call does nothing).

        A process group still referenced keeps its threads until interpreter exit, so the closed communicator lets
        go of it too, and what still refers to it through cycles is collected.
        """
        self.comm.close()
        group, self.group = self.group, None
        if group is not None:
            if getattr(self.comm, "group", None) is group:
                self.comm.group = None
            dist.destroy_process_group(group)
            del group
            gc.collect()


def average_state(wrapper: DecentralizedDataParallel) -> dict[str, Any]:
    """The average of the replicas as a state dict of new tensors (a collective; floating buffers averaged too).

    Args:
        wrapper: the open wrapper.

    Returns:
        ``{name: tensor}`` of the averaged module, detached copies that outlive the wrapper.
    """
    with wrapper.averaged(buffers=True) as average:
        return {name: value.detach().clone() for name, value in average.state_dict().items()}


def close_on_average(wrapper: DecentralizedDataParallel, group: GossipGroup, average: bool) -> None:
    """End a run: with ``average``, every rank's module takes the replicas' average; then close everything.

    A collective. The wrapper is closed first (it completes an exchange in flight), the communicator and its group
    last; the module keeps its parameters, views of the wrapper's buckets, and trains or evaluates as any module.

    Args:
        wrapper: the run's open wrapper.
        group: its communicator's group.
        average: load the average into the module on every rank (as DDP's replicas end equal).
    """
    state = average_state(wrapper) if average and not wrapper.closed else None
    wrapper.close()
    if state is not None:
        wrapper.module.load_state_dict(state)
    group.close()
