"""Process exit with live communicators: a clean exit without ceremony, and never an abort.

Two rules, for every real communicator (registered by :func:`watch`):

* **Normal exit** (the script ends, or calls ``sys.exit``): an ``atexit`` handler closes every communicator that
  is still open -- barrier, then teardown of the process group the library created -- so a script that never calls
  ``comm.close()`` or ``model.close()`` exits like one that does. Without it, Gloo's threads live into interpreter
  finalization, where their destructors abort the process ("terminate called without an active exception",
  SIGABRT, torchrun's ``ChildFailedError``; docs/design.md J).
* **An uncaught exception** while a communicator is open or has failed: the hook prints the traceback as usual (the
  previous hook), flushes stdout and stderr, and ends the process with ``os._exit(1)`` -- the status Python itself
  gives an uncaught exception -- without the backend's teardown. That teardown would wait for peers that are not
  coming (a barrier, or MPICH's ``MPI_Finalize`` after a peer died) or abort inside Gloo's destructors. The peers
  learn of the exit at once (Gloo: closed connection; MPI: the launcher). A communicator's ``exit_delay`` (seconds,
  0 when absent) is waited before ``os._exit``.

A program that catches a communication error and exits by itself owns the teardown; ``os._exit`` after flushing
is the safe way out.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any

_lock = threading.Lock()
_watched: list[Any] = []  # strong references: a communicator dropped by the user still holds its process group
_previous_hook: Any = None
_atexit_registered = False


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()


def _open(comm: Any) -> bool:
    return not getattr(comm, "_closed", True)


def _hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
    (_previous_hook or sys.__excepthook__)(kind, value, traceback)
    watched = list(_watched)
    if any(getattr(comm, "failure", None) is not None or _open(comm) for comm in watched):
        _flush()
        # A backend may ask for a moment before the exit: MPICH's Hydra SIGKILLs every other process of the job when
        # this one exits, which must not come before they have said what they saw (see gossip.backends.mpi).
        time.sleep(max((getattr(comm, "exit_delay", 0.0) for comm in watched), default=0.0))
        os._exit(1)


def _close_open_communicators() -> None:
    """At normal interpreter exit: close what the program left open, newest first."""
    for comm in reversed(list(_watched)):
        if _open(comm):
            comm.close()
    _watched.clear()


def _wraps_ours(hook: Any, depth: int = 0) -> bool:
    """Whether ``hook`` is this module's hook or a wrapper that calls it (e.g. the one ``init_process_group``
    installs over the current hook each time a group is created: re-installing ours on top would close a cycle)."""
    if hook is _hook:
        return True
    if depth >= 8:
        return False
    for cell in getattr(hook, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            if callable(cell.cell_contents) and _wraps_ours(cell.cell_contents, depth + 1):
                return True
    return False


def watch(comm: Any) -> None:
    """Apply the exit rules above to ``comm``.

    Args:
        comm: a communicator with a ``failure`` attribute (None while healthy), a ``_closed`` flag and an
            idempotent ``close()``.
    """
    global _previous_hook, _atexit_registered
    with _lock:
        _watched[:] = [c for c in _watched if _open(c)]  # forget closed ones
        _watched.append(comm)
        if not _wraps_ours(sys.excepthook):
            _previous_hook = sys.excepthook
            sys.excepthook = _hook
        if not _atexit_registered:
            atexit.register(_close_open_communicators)
            _atexit_registered = True
