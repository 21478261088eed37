"""A stand-in for ``python`` that runs its program in a process forked from the tests' warm server.

:func:`helpers.warm_workers.warm_python` writes this file, after a shebang line naming the real interpreter (run
with ``-I -S``: no site, no environment of ours) and the two constants ``SOCKET`` and ``REAL_PYTHON``, as an
executable called ``python``; ``mpiexec``, a launcher or torchrun then start it as they would start ``python``. It
hands the server (:mod:`helpers.warm_workers`) its arguments, environment, working directory and standard streams
(and the descriptor MPICH's ``PMI_FD`` names), relays the signals it receives to the forked worker, and ends as the
worker ended: its exit status, or killed by the same signal. Arguments the server cannot run (an interpreter
option other than ``-u``) or a server that does not answer: it becomes the real interpreter instead (``exec``).
"""

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable

HEADER = struct.Struct("!Q")  # as helpers.warm_workers.HEADER: the JSON request's length
#: what a launcher sends its workers and a worker must receive; SIGKILL and SIGSTOP cannot be caught (the server
#: kills the worker when this process dies)
RELAYED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM,
           signal.SIGALRM, signal.SIGCONT)  # fmt: skip


def forkable(args: list[str]) -> bool:
    """Whether the server runs ``python ARGS``: ``[-u] SCRIPT ...``, ``[-u] -m MODULE ...`` or ``[-u] -c CODE ...``,
    except multiprocessing's own children (spawn, forkserver), which inherit descriptors the stand-in does not pass."""
    args = args[1:] if args[:1] == ["-u"] else args
    if not args or any("multiprocessing" in arg for arg in args):
        return False
    if args[0] in ("-m", "-c"):
        return len(args) > 1
    return not args[0].startswith("-") and os.path.isfile(args[0])


def _as_the_real_interpreter(args: list[str]) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)  # exec keeps the mask
    real = globals()["REAL_PYTHON"]
    os.execv(real, [real, *args])


def _read_line(connection: socket.socket) -> dict | None:
    text = b""
    while not text.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            return None
        text += chunk
    return json.loads(text)


def _end_as(status: int) -> None:
    """Exit with ``status`` (``Popen.returncode``'s convention): the code, or death by the signal ``-status``."""
    if status >= 0:
        os._exit(status)
    if -status not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(-status, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [-status])
    os.kill(os.getpid(), -status)
    os._exit(128 - status)  # a signal whose default is not to end the process


def relay_to(pid: int) -> Callable[[int, object], None]:
    """A handler that passes the signal it receives on to process ``pid``, and ignores it once ``pid`` has ended.

    The server reaps the program before it says how it ended, so a signal can reach the stand-in in between; the
    stand-in then ends as its program did, and an error raised here would end it otherwise (a traceback, then killed
    by the launcher's next signal once the interpreter's finalization has restored the default handlers).
    """

    def relay(received: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, received)

    return relay


def main() -> None:
    # held until the program exists, then relayed to it: a signal never ends the stand-in while its program runs on
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    args = sys.argv[1:]
    if not forkable(args):
        _as_the_real_interpreter(args)
    targets = [0, 1, 2] + ([int(os.environ["PMI_FD"])] if "PMI_FD" in os.environ else [])
    request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "fds": targets,
               "executable": os.path.abspath(sys.argv[0])}  # fmt: skip
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(globals()["SOCKET"])
    except OSError:
        _as_the_real_interpreter(args)
    text = json.dumps(request).encode()
    socket.send_fds(connection, [HEADER.pack(len(text))], targets)
    connection.sendall(text)
    started = _read_line(connection)
    if started is None:
        print("warm python: the server closed the connection before forking", file=sys.stderr)
        os._exit(1)
    for number in RELAYED:
        signal.signal(number, relay_to(started["pid"]))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    ended = _read_line(connection)
    if ended is None:
        print("warm python: the server closed the connection before the worker ended", file=sys.stderr)
        os._exit(1)
    _end_as(ended["status"])


if __name__ == "__main__":
    main()
