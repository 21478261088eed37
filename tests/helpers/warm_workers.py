"""Worker processes forked from one warm Python instead of started from scratch: the tests' Gloo jobs start in
a fraction of the time.

A fresh ``python worker.py`` spends seconds of CPU importing torch, ``torch._dynamo`` (which torch.optim's first
optimizer imports) and this repository before the worker's first line; a test suite of multi-process jobs is
mostly that. Here one server process (``python warm_workers.py``, started once per test session) imports them once,
with the workers' base environment (:func:`helpers.launch._env`: ``OMP_NUM_THREADS=1``, the repository on
``PYTHONPATH``), and stays single-threaded; each worker is an ``os.fork()`` of it that then becomes
``python SCRIPT ARGS`` as far as the script can tell (the server's objects are frozen out of the collector first,
so the children do not copy its pages by touching them): its own environment, ``sys.argv``, ``sys.path[0]``, working
directory, standard input from ``/dev/null``, standard output and error to a file, and the script run as
``__main__``. It ends as any interpreter does (atexit handlers, thread shutdown, the exit status of ``SystemExit``
or 1 after an uncaught exception's traceback), so the exit paths the tests check are the ordinary ones.

The server speaks JSON lines: a request ``{"id", "argv", "env", "cwd", "output"}`` on its standard input is
answered ``{"id", "pid"}`` once forked, and every worker's end ``{"pid", "status"}`` (``returncode``'s convention:
the exit status, or minus the signal) as it is reaped. :class:`WarmWorker` is the client's handle, with the part
of ``subprocess.Popen``'s interface that the launch helpers use.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

#: what the server imports before it forks anything: what the workers would otherwise import one by one
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "gossip", "optim", "topologies")


def _become_the_script(request: dict[str, Any]) -> None:
    """In the forked child: set up the process as ``python SCRIPT ARGS`` would be, then run SCRIPT as __main__.

    The script's module replaces the server's in ``sys.modules["__main__"]`` and stays there, so its globals live
    until the interpreter's finalisation, after the atexit handlers, as in a process started from scratch.
    """
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    quiet = os.open(os.devnull, os.O_RDONLY)
    os.dup2(quiet, 0)
    os.close(quiet)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 -- the process's own stream, open until it exits
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(script).resolve().parent)
    gc.enable()
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(Path(script).read_bytes(), script, "exec"), main.__dict__)
    raise SystemExit(0)


def serve() -> None:
    """The server's loop: fork on each request, report each child's end; exits when its standard input closes."""
    gc.disable()  # no collection leaves holes in the pages the children share (the gc module's advice for fork)
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the children's collections and exit then leave the preloaded objects' pages alone (no copy)
    reply = sys.stdout
    pending = b""
    running: set[int] = set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            reply.flush()
            pid = os.fork()
            if pid == 0:
                _become_the_script(request)  # never returns: SystemExit or an uncaught exception ends the child
            running.add(pid)
            reply.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
            reply.flush()
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                reply.write(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}) + "\n")
                reply.flush()


class _Server:
    """The client's side: one server per test session, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        command = [sys.executable, __file__]
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.changed = threading.Condition()
        self.started: dict[int, int] = {}
        self.ended: dict[int, int] = {}
        self.next_id = 0
        threading.Thread(target=self._read_replies, name="warm-workers-replies", daemon=True).start()

    def _read_replies(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self.changed:
                if "id" in message:
                    self.started[message["id"]] = message["pid"]
                else:
                    self.ended[message["pid"]] = message["status"]
                self.changed.notify_all()
        with self.changed:
            self.process.wait()
            self.changed.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], output: Path) -> int:
        with self.changed:
            self.next_id += 1
            request = {"id": self.next_id, "argv": argv, "env": env, "cwd": os.getcwd(), "output": str(output)}
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            if not self.changed.wait_for(lambda: request["id"] in self.started or self.process.poll() is not None, 60):
                raise RuntimeError("the warm-worker server did not answer a fork request within 60 s")
            if request["id"] not in self.started:
                raise RuntimeError(f"the warm-worker server exited with status {self.process.returncode}")
            return self.started.pop(request["id"])


_server: _Server | None = None
_server_lock = threading.Lock()


def server(env: dict[str, str]) -> _Server:
    """The session's server, started with ``env`` (the workers' base environment) on first use."""
    global _server
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = _Server(env)
        return _server


class WarmWorker:
    """``python argv[0] argv[1:]`` with environment ``env``, forked from the warm server; output to ``output``.

    Args:
        argv: the script and its arguments (no interpreter).
        env: the worker's whole environment.
        output: the file its standard output and error go to (truncated).
        base_env: the environment to start the server with, if it is not running yet.
    """

    def __init__(self, argv: list[str], env: dict[str, str], output: Path, base_env: dict[str, str]) -> None:
        self._server = server(base_env)
        self.output = output
        self.pid = self._server.fork(argv, env, output)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self._server.changed:
            if self.returncode is None and self.pid in self._server.ended:
                self.returncode = self._server.ended.pop(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(str(self.output), timeout or 0.0)
                self._server.changed.wait(left)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended and is not reaped yet
                os.kill(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    serve()
