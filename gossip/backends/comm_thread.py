"""The thread that runs a communicator's operations in submission order, and the handles of started operations.

Every rank submits the same operations in the same order, so running them in FIFO order on one thread keeps the
ranks matched; a wait names what it still waits for when it times out (:class:`Progress`).
"""

from __future__ import annotations

import abc
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gossip.errors import (
    CommTimeoutError,
    UseAfterCloseError,
)


@dataclass
class Progress:
    """What an operation still waits for, kept up to date so that a timeout can name the missing peers.

    Attributes:
        operation: the operation, in words (e.g. ``"exchange 12"``).
        outstanding: the parts not yet complete (e.g. ``"receive from 3"``), in the order added.
    """

    operation: str
    outstanding: dict[str, None] = field(default_factory=dict)

    def add(self, part: str) -> None:
        """Mark ``part`` as outstanding.

        Args:
            part: what the operation waits for, in words.
        """
        self.outstanding[part] = None

    def finish(self, part: str) -> None:
        """Mark ``part`` as complete.

        Args:
            part: a part given to :meth:`add`.
        """
        self.outstanding.pop(part, None)

    def describe(self) -> str:
        """The operation and what it still waits for, for a timeout's message.

        Returns:
            The outstanding parts, comma-separated, or that the operation has yet to return when none is left.
        """
        parts = list(self.outstanding)
        return ", ".join(parts) if parts else f"{self.operation} to return (every transfer is done)"


class Handle(abc.ABC):
    """A started operation. ``wait`` completes it (or raises); ``wait_seconds`` is the time spent blocked."""

    wait_seconds: float = 0.0

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the operation has completed; never blocks and never drives progress itself.

        Returns:
            Whether :meth:`wait` would return at once.
        """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise :class:`CommTimeoutError` naming the missing peers after ``timeout``.

        Args:
            timeout: seconds to wait at most; None waits the communicator's timeout.
        """


class CompletedHandle(Handle):
    """A handle on an operation that completed before it was created (e.g. one restored from a checkpoint)."""

    def done(self) -> bool:
        """Always True.

        Returns:
            True.
        """
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Return at once.

        Args:
            timeout: ignored.
        """


class FutureHandle(Handle):
    """A handle on an operation run by a :class:`CommThread`.

    Args:
        future: the future the thread completes.
        progress: the operation's :class:`Progress`, to name what is missing on a timeout.
        owner: the thread running it.
    """

    def __init__(self, future: concurrent.futures.Future, progress: Progress, owner: CommThread):
        self._future = future
        self.progress = progress
        self._owner = owner

    def done(self) -> bool:
        """True once the thread has completed the operation.

        Returns:
            Whether :meth:`wait` would return at once.
        """
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the thread has completed the operation, and raise its error if it failed.

        Args:
            timeout: seconds to wait at most; None waits the thread's timeout.

        Raises:
            error: the operation's own error, or :class:`CommTimeoutError` naming what it still waits for when
                ``timeout`` expires (the thread is then failed, so every later operation says so).
        """
        timeout = self._owner.timeout if timeout is None else timeout
        start = time.perf_counter()
        try:
            self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            error = CommTimeoutError(
                f"rank {self._owner.rank}: {self.progress.operation} timed out after {timeout:.1f} s; "
                f"still waiting for {self._owner.pending_description(self.progress)}"
            )
            self._owner.fail(error)
            raise error from None
        finally:
            self.wait_seconds += time.perf_counter() - start


class CommThread:
    """One thread that runs a communicator's operations in submission order.

    Every rank submits the same operations in the same order, so running them in FIFO order on one thread keeps
    the ranks matched. The thread, not the training thread, drives transfers forward: Gloo progresses by
    itself, while an MPI request only advances inside MPI calls, which this thread makes (polling with short
    sleeps rather than a busy wait, so it does not burn a core that the training needs). After one failure the
    communicator is unusable, as a Gloo process group is after a timeout, and every later operation says so.

    Args:
        name: the thread's name.
        rank: this rank, for messages.
        timeout: seconds a wait lasts by default.
    """

    def __init__(self, name: str, rank: int, timeout: float):
        self.rank = rank
        self.timeout = timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._running: Progress | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, operation: str, run: Callable[[Progress], Any]) -> FutureHandle:
        """Queue ``run`` to run after every operation submitted before it.

        Args:
            operation: the operation, in words, for messages.
            run: the operation itself; it reports what it waits for in the :class:`Progress` it is given.

        Returns:
            A handle whose ``wait`` returns (or raises) what ``run`` did.
        """
        progress = Progress(operation)
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._failure is not None:
            future.set_exception(self._refusal(operation))
        else:
            self._queue.put((run, progress, future))
        return FutureHandle(future, progress, self)

    def _refusal(self, operation: str) -> UseAfterCloseError:
        return UseAfterCloseError(
            f"rank {self.rank}: {operation} refused: this communicator is unusable after an earlier failure: "
            f"{self._failure}"
        )

    def call(self, operation: str, run: Callable[[Progress], Any], timeout: float | None = None) -> Any:
        """Run ``run`` on the thread and wait for it: :meth:`submit`, then ``wait``.

        Args:
            operation: the operation, in words, for messages.
            run: the operation itself.
            timeout: seconds to wait at most; None waits the thread's timeout.

        Returns:
            What ``run`` returned.
        """
        handle = self.submit(operation, run)
        handle.wait(timeout)
        return handle._future.result()

    def fail(self, error: BaseException) -> None:
        """Mark the thread failed with ``error``: every later operation is refused, naming it.

        Args:
            error: the failure to report (the first one is kept).
        """
        if self._failure is None:
            self._failure = error

    @property
    def failure(self) -> BaseException | None:
        """The failure that made this thread unusable, or None."""
        return self._failure

    @property
    def running(self) -> Progress | None:
        """The operation this thread is running now (None when idle)."""
        return self._running

    def pending_description(self, progress: Progress) -> str:
        """What ``progress``'s operation still waits for, and what runs before it, for a timeout's message.

        Args:
            progress: a submitted operation's progress.

        Returns:
            The operation and its missing parts, in words.
        """
        running = self._running
        if running is not None and running is not progress:
            return f"an earlier operation ({running.operation}) still waiting for {running.describe()}"
        return progress.describe()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, progress, future = item
            if self._failure is not None:
                future.set_exception(self._refusal(progress.operation))
                continue
            self._running = progress
            try:
                future.set_result(run(progress))
            except BaseException as error:  # handed to the waiting thread, which re-raises it
                self.fail(error)
                future.set_exception(error)
            finally:
                self._running = None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after the operations already queued, waiting for it at most ``timeout``.

        Args:
            timeout: seconds to wait for the thread to end.
        """
        self._queue.put(None)
        self._thread.join(timeout)
