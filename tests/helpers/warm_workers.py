"""Worker processes forked from one warm Python instead of started from scratch: the tests' jobs start in a
fraction of the time.

A fresh ``python worker.py`` spends seconds of CPU importing torch, ``torch._dynamo`` (which torch.optim's first
optimizer imports), matplotlib (the main job's plots) and this repository before the worker's first line; a test
suite of multi-process jobs is mostly that. Here one server process (``python warm_workers.py SOCKET``, started once
per test session) imports them once, with the workers' base environment (:func:`helpers.launch._env`:
``OMP_NUM_THREADS=1``, the repository on ``PYTHONPATH``), and stays single-threaded; each worker is an ``os.fork()``
of it that then becomes ``python ARGS`` as far as the program can tell (the server's objects are frozen out of the
collector first, so the children do not copy its pages by touching them): its own environment, ``sys.argv``,
``sys.path[0]``, working directory, standard streams, and the script, module (``-m``) or code (``-c``) run as
``__main__``. It ends as any interpreter does (atexit handlers, thread shutdown, the exit status of ``SystemExit``
or 1 after an uncaught exception's traceback), so the exit paths the tests check are the ordinary ones.

Two ways in:

* From the test process: :class:`WarmWorker`, the part of ``subprocess.Popen``'s interface that the launch helpers
  use. The request ``{"id", "argv", "env", "cwd", "output"}`` goes to the server's standard input as a JSON line,
  answered ``{"id", "pid"}`` once forked, and every such worker's end ``{"pid", "status"}`` (``returncode``'s
  convention: the exit status, or minus the signal) as it is reaped; the worker's output goes to a file.
* From a process that someone else started: :func:`warm_python` is the path of an executable that stands in for
  ``python`` (:mod:`helpers.warm_python`), for ``mpiexec``, a launcher or torchrun to start. It hands the server
  its arguments, environment, working directory and its own standard streams (and MPICH's ``PMI_FD``) over the
  server's Unix socket, then relays signals to the forked worker and ends as the worker ended; if it dies first,
  the server kills the worker. A worker started that way has the stand-in as ``sys.executable``, so the processes
  it starts in turn (a launcher's workers) are warm too.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import gc
import json
import os
import runpy
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

#: what the server imports before it forks anything: what the workers would otherwise import one by one
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "matplotlib.pyplot", "gossip", "optim", "topologies")
#: where a stand-in's descriptors wait in the child while the server's own are closed
_PARKED = 900
#: the message header on the socket: the JSON request's length
HEADER = struct.Struct("!Q")
STAND_IN = Path(__file__).resolve().with_name("warm_python.py")


def _set_streams(unbuffered: bool) -> None:
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 -- the process's own stream, open until it exits
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(write_through=unbuffered)  # python -u
    sys.stderr.reconfigure(write_through=True)  # as the interpreter's own standard error


def _run_as_main(request: dict[str, Any]) -> None:
    """In the forked child, with its streams in place: become ``python ARGS`` and run the program as __main__.

    ``ARGS`` is ``[-u] SCRIPT ...``, ``[-u] -m MODULE ...`` or ``[-u] -c CODE ...`` (what
    :func:`helpers.warm_python.forkable` accepts). The program's module replaces the server's in
    ``sys.modules["__main__"]`` and stays there, so its globals live until the interpreter's finalisation, after
    the atexit handlers, as in a process started from scratch.
    """
    args = list(request["argv"])
    unbuffered = args[0] == "-u"
    args = args[unbuffered:]
    _set_streams(unbuffered)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if "multiprocessing.process" in sys.modules:  # what it took from the server's working directory at import
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = os.getcwd()
    if "executable" in request:
        sys.executable = request["executable"]
    gc.enable()
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    if args[0] == "-m":
        sys.argv = ["-m", *args[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(args[1], alter_argv=True)  # what ``python -m`` itself calls
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = args
        sys.path[0] = str(Path(args[0]).resolve().parent)
        main.__file__ = os.path.abspath(args[0])  # as Python 3.9+ sets it
        exec(compile(Path(args[0]).read_bytes(), main.__file__, "exec"), main.__dict__)
    raise SystemExit(0)


def _become_worker(request: dict[str, Any], server_sockets: list[socket.socket]) -> None:
    """A child for :class:`WarmWorker`: standard input from /dev/null, output and errors to the request's file."""
    for held in server_sockets:
        os.close(held.detach())
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    quiet = os.open(os.devnull, os.O_RDONLY)
    os.dup2(quiet, 0)
    os.close(quiet)
    _run_as_main(request)


def _become_stand_ins_worker(request: dict[str, Any], fds: list[int], server_sockets: list[socket.socket]) -> None:
    """A child for a stand-in: its descriptors ``fds`` become the numbers ``request["fds"]`` names (0, 1, 2 and
    MPICH's ``PMI_FD`` if set), every other descriptor the server held is closed."""
    for held in server_sockets:
        held.detach()  # closed below with the rest; the objects must not close a reused number at exit
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD, _PARKED) for fd in fds]
    os.closerange(0, _PARKED)
    os.closerange(_PARKED + len(parked), os.sysconf("SC_OPEN_MAX"))
    for fd, target in zip(parked, request["fds"], strict=True):
        os.dup2(fd, target)
        os.close(fd)
    _run_as_main(request)


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A stand-in's request: the header with its descriptors, then the JSON text."""
    header, fds, _, _ = socket.recv_fds(connection, HEADER.size, 8)
    (length,) = HEADER.unpack(header)
    text = b""
    while len(text) < length:
        chunk = connection.recv(length - len(text))
        if not chunk:
            raise ConnectionError("the stand-in closed its connection mid-request")
        text += chunk
    return json.loads(text), fds


def serve(socket_path: str) -> None:
    """The server's loop: fork on each request, report each child's end; exits when its standard input closes."""
    gc.disable()  # no collection leaves holes in the pages the children share (the gc module's advice for fork)
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the children's collections and exit then leave the preloaded objects' pages alone (no copy)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".binding")
    listener.listen(64)
    os.rename(socket_path + ".binding", socket_path)  # the path appears once connections are accepted
    reply = sys.stdout
    pending = b""
    running: dict[int, socket.socket | None] = {}  # pid -> the stand-in's connection (None: a WarmWorker's)

    def held() -> list[socket.socket]:
        """The server's open sockets, which a child must not keep."""
        return [listener, *(c for c in running.values() if c is not None)]

    while True:
        readable, _, _ = select.select([0, *held()], [], [], 0.02)
        for ready in readable:
            if ready == 0:
                chunk = os.read(0, 65536)
                if not chunk:
                    return
                pending += chunk
            elif ready is listener:
                connection, _ = listener.accept()
                request, fds = _receive(connection)
                reply.flush()
                pid = os.fork()
                if pid == 0:
                    _become_stand_ins_worker(request, fds, [*held(), connection])
                for fd in fds:
                    os.close(fd)
                running[pid] = connection
                connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:  # a stand-in said nothing more: it died (SIGKILL) before its worker, which must follow it
                pid = next(p for p, c in running.items() if c is ready)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                running[pid] = None
                ready.close()
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            reply.flush()
            pid = os.fork()
            if pid == 0:
                # never returns: SystemExit or an uncaught exception ends the child
                _become_worker(request, held())
            running[pid] = None
            reply.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
            reply.flush()
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = running.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                if connection is None:
                    reply.write(json.dumps({"pid": pid, "status": code}) + "\n")
                    reply.flush()
                else:
                    with contextlib.suppress(OSError):
                        connection.sendall(json.dumps({"status": code}).encode() + b"\n")
                    connection.close()


class _Server:
    """The client's side: one server per test session, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="warm-workers-")
        self.socket_path = os.path.join(self.directory, "server.sock")
        self.stand_in = os.path.join(self.directory, "python")
        # the stand-in knows its server and the real interpreter; a launcher passes it no environment of ours
        header = f"#!{sys.executable} -IS\nSOCKET = {self.socket_path!r}\nREAL_PYTHON = {sys.executable!r}\n"
        Path(self.stand_in).write_text(header + STAND_IN.read_text())
        os.chmod(self.stand_in, stat.S_IRWXU)
        command = [sys.executable, __file__, self.socket_path]
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

    def ready(self, timeout: float = 120.0) -> None:
        """Wait until the server listens (it binds its socket once the preloading is done)."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None:
                raise RuntimeError(f"the warm-worker server exited with status {self.process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the warm-worker server did not listen within {timeout} s")
            time.sleep(0.05)


_server: _Server | None = None
_server_lock = threading.Lock()


def server(env: dict[str, str]) -> _Server:
    """The session's server, started with ``env`` (the workers' base environment) on first use."""
    global _server
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = _Server(env)
        return _server


def warm_python(base_env: dict[str, str]) -> str:
    """The path of the session's stand-in for ``python`` (see the module's docstring), the server started with
    ``base_env`` and listening."""
    session = server(base_env)
    session.ready()
    return session.stand_in


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
    serve(sys.argv[1])
