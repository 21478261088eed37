"""The optimizer-step hook registry: torch.optim's global step hooks, dispatched to the objects that claim a step.

A data-parallel wrapper must act around every ``optimizer.step()`` over its parameters -- the gossip wrapper
completes the mixing before the update and starts the next exchange after it; the DDP baseline records its
metrics row -- whatever optimizer the user created. torch offers global hooks for that
(``register_optimizer_step_pre_hook`` / ``..._post_hook``). This module registers *one* pair per process while
any listener is subscribed and dispatches each step to the listeners whose :meth:`StepListener.owns` claims the
optimizer, through their public methods only.

One pair per process, not one per listener: registering mutates torch's global hook dict, and the simulator's
ranks are threads, one of which may be iterating that dict inside ``optimizer.step()`` while another subscribes.

An optimizer subclass whose ``step()`` calls ``super().step()`` fires the hooks once per level; a listener sees
only the outermost call (the nesting depth is counted here, per listener). When ``before_optimizer_step`` raises,
torch skips the post-hooks, so the depth is reset at once.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class StepListener(Protocol):
    """What the registry calls; the gossip wrapper and the DDP baseline implement it."""

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s steps concern this listener (it may raise on a partial optimizer).

        Args:
            optimizer: the optimizer about to step.

        Returns:
            True when the listener handles its steps.
        """
        ...

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, computes_gradients: bool) -> None:
        """Called before the outermost ``optimizer.step()``.

        Args:
            optimizer: the optimizer that steps.
            computes_gradients: a closure (not None) was passed, so the step computes its own gradients.
        """
        ...

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called after the outermost ``optimizer.step()`` returned.

        Args:
            optimizer: the optimizer that stepped.
        """
        ...


_lock = threading.Lock()
_live: weakref.WeakSet = weakref.WeakSet()
_depth: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # listener -> nesting of optimizer.step() calls
_torch_hooks: list[Any] = []


def subscribe(listener: StepListener) -> None:
    """Dispatch every later optimizer step to ``listener`` (held weakly) until :func:`unsubscribe`.

    Args:
        listener: the wrapper (or baseline) to call around each optimizer step.
    """
    with _lock:
        _live.add(listener)
        _depth[listener] = 0
        if not _torch_hooks:
            _torch_hooks.extend(
                [register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step)]
            )


def unsubscribe(listener: StepListener) -> None:
    """Stop dispatching to ``listener``; the torch hooks go when the last listener does.

    Args:
        listener: a subscribed listener (one not subscribed is ignored).
    """
    with _lock:
        _live.discard(listener)
        _depth.pop(listener, None)
        if not _live:
            for hook in _torch_hooks:
                hook.remove()
            _torch_hooks.clear()


def listeners() -> list[StepListener]:
    """The subscribed listeners (a snapshot).

    Returns:
        The listeners alive now, in subscription order.
    """
    with _lock:
        return list(_live)


def _enter(listener: StepListener) -> int:
    with _lock:
        _depth[listener] = _depth.get(listener, 0) + 1
        return _depth[listener]


def _leave(listener: StepListener) -> int:
    """Decrease the nesting depth; return the depth before (1 for the outermost call)."""
    with _lock:
        depth = _depth.get(listener, 0)
        _depth[listener] = max(0, depth - 1)
        return depth


def _reset(listener: StepListener) -> None:
    with _lock:
        _depth[listener] = 0


def passes_closure(args: Any, kwargs: Any) -> bool:
    """Whether an ``optimizer.step(...)`` call, as torch's step hooks see it, passes a closure.

    ``args[0]`` is the optimizer itself. A closure given positionally or as ``closure=`` computes the gradients
    inside ``step()``; ``None`` in its place is no closure: ``step(None)`` is how Accelerate's optimizer wrapper
    (``self.optimizer.step(closure)`` with its default ``None``) and ``GradScaler.step(optimizer, None)`` call an
    ordinary step.

    Args:
        args: the positional arguments of the call, the optimizer first.
        kwargs: its keyword arguments.

    Returns:
        True when a closure (anything but None) was passed.
    """
    return any(arg is not None for arg in args[1:]) or kwargs.get("closure") is not None


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    computes_gradients = passes_closure(args, kwargs)
    for listener in listeners():
        if listener.owns(optimizer) and _enter(listener) == 1:
            try:
                listener.before_optimizer_step(optimizer, computes_gradients)
            except BaseException:
                _reset(listener)  # torch skips the post-hooks when a pre-hook raises
                raise


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for listener in listeners():
        if listener.owns(optimizer) and _leave(listener) == 1:
            listener.after_optimizer_step(optimizer)
