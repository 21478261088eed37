"""Leave the process promptly after a communication failure, with the status of an uncaught exception.

After a peer died, the normal interpreter teardown can hang or crash inside the backend: MPICH's
``MPI_Finalize`` (run by mpi4py at exit) waits for the dead process, and Gloo's destructors may abort with
"terminate called without an active exception" (docs/design.md J). So every real communicator registers here, and
when an exception reaches the top level (``sys.excepthook``) while one of them has failed, the hook prints the
traceback as usual (the previous hook), flushes stdout and stderr, and ends the process with ``os._exit(1)`` --
the status Python itself gives an uncaught exception. Nothing changes for a healthy run, for an exception
unrelated to a failed communicator's state (every communicator healthy), or for a program that catches the error
and exits by itself (it then owns the teardown; ``os._exit`` after flushing is the safe way out).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from types import TracebackType
from typing import Any

_lock = threading.Lock()
_watched: weakref.WeakSet = weakref.WeakSet()
_previous_hook: Any = None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()


def _hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
    (_previous_hook or sys.__excepthook__)(kind, value, traceback)
    if any(getattr(comm, "failure", None) is not None for comm in list(_watched)):
        _flush()
        os._exit(1)


def watch(comm: Any) -> None:
    """Apply the exit rule above to ``comm`` (anything with a ``failure`` attribute: None while healthy)."""
    global _previous_hook
    with _lock:
        _watched.add(comm)
        if sys.excepthook is not _hook:
            _previous_hook = sys.excepthook
            sys.excepthook = _hook
