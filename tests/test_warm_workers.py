"""A worker forked from the warm server (tests/helpers/warm_workers.py) is, to its script, ``python SCRIPT ARGS``:
its own environment, arguments, ``sys.path[0]``, working directory and output; its exit status; atexit handlers and
the script's globals alive until the interpreter's end; a signal's death reported as ``Popen`` reports it.

The stand-in for ``python`` (tests/helpers/warm_python.py) runs a script, ``-m`` module or ``-c`` code as the real
interpreter does (the same arguments, ``sys.path[0]``, working directory, ``__name__``, environment and exit status
as a real ``python`` in the same place), except that it runs warm and has the stand-in as ``sys.executable``, so
what the program starts with it starts warm too; an option it does not take runs the real interpreter; a signal to
it reaches the program and the program's end is its own (a status, or death by the same signal); killed, it takes
its program with it; and ranks that ``mpiexec`` starts through it meet (MPICH's ``PMI_FD`` passes)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import warm_python as stand_in
from helpers.launch import _env, mpiexec, start_worker
from helpers.warm_workers import warm_python

pytestmark = pytest.mark.multiprocess

SCRIPT = """
import atexit, json, os, sys

class Witness:
    def __del__(self):
        print("globals alive at the end:", LEFT_FOR_EXIT, flush=True)

LEFT_FOR_EXIT = "yes"
witness = Witness()
print("argv", sys.argv[1:])
with open(os.path.join(os.path.dirname(__file__), "env.json"), "w") as file:
    json.dump(dict(os.environ), file)
print("path0", sys.path[0], "cwd", os.getcwd(), "main", __name__)
atexit.register(lambda: print("atexit ran", flush=True))
mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("the script's own error")
if mode == "sleep":
    import time
    time.sleep(60)
"""


@pytest.fixture
def script(tmp_path, monkeypatch):
    path = tmp_path / "scripts" / "worker.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    monkeypatch.setenv("SET_AFTER_THE_SERVER_STARTED", "1")
    monkeypatch.chdir(tmp_path)
    return path


def run(script: Path, mode: str) -> tuple[int, str]:
    worker = start_worker([str(script), mode], {"RANK": "2"}, script.parent / f"{mode}.out")
    return worker.wait(timeout=60), (script.parent / f"{mode}.out").read_text()


def test_a_normal_end_exits_zero_after_atexit_with_the_scripts_own_view(script):
    status, output = run(script, "ok")
    assert status == 0, output
    assert "argv ['ok']" in output
    assert json.loads((script.parent / "env.json").read_text()) == _env({"RANK": "2"})  # exactly, nothing else
    assert f"path0 {script.parent} cwd {script.parent.parent} main __main__" in output
    assert "atexit ran" in output and "globals alive at the end: yes" in output


@pytest.mark.parametrize(("mode", "status", "text"), [("exit3", 3, "atexit ran"), ("raise", 1, "ValueError")])
def test_sys_exit_and_an_uncaught_exception_give_the_interpreters_status(script, mode, status, text):
    got, output = run(script, mode)
    assert got == status, output
    assert text in output
    if mode == "raise":
        assert "Traceback (most recent call last)" in output and "the script's own error" in output


def test_a_killed_worker_reports_minus_the_signal(script):
    worker = start_worker([str(script), "sleep"], {"RANK": "0"}, script.parent / "sleep.out")
    deadline = time.monotonic() + 30
    output = script.parent / "sleep.out"  # the child creates it
    while "path0" not in (output.read_text() if output.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.poll() is None
    worker.kill()
    assert worker.wait(timeout=30) == -signal.SIGKILL


# The stand-in for ``python`` (tests/helpers/warm_python.py), which mpiexec, launchers and torchrun start.


def python() -> str:
    """The stand-in, also under GOSSIP_TEST_COLD_START=1 (which only keeps the other tests from using it)."""
    return warm_python(_env({}))


PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "file": globals().get("__file__"), "env": dict(os.environ), "warm": "torch" in sys.modules,
                  "executable": sys.executable}))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def _probe(interpreter: str, args: list[str], cwd: Path) -> tuple[int, dict]:
    job = subprocess.run([interpreter, *args], cwd=cwd, env={"PROBE_EXIT": "3", "ONLY": "this"}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    return job.returncode, json.loads(job.stdout)


@pytest.mark.parametrize("form", ["script", "module", "code", "unbuffered module"])
def test_the_stand_in_runs_a_program_as_python_does_forked_warm(tmp_path, form):
    (tmp_path / "probe.py").write_text(PROBE)
    args = {"script": ["probe.py", "a", "b"], "module": ["-m", "probe", "a"], "code": ["-c", PROBE, "a"],
            "unbuffered module": ["-u", "-m", "probe", "a"]}[form]  # fmt: skip
    stand_in = python()
    real_status, real = _probe(sys.executable, args, tmp_path)
    status, got = _probe(stand_in, args, tmp_path)
    assert status == real_status == 3
    assert (got.pop("executable"), got.pop("warm")) == (stand_in, True)
    assert (real.pop("executable"), real.pop("warm")) == (sys.executable, False)
    assert got == real  # argv, sys.path[0], cwd, __name__, __file__ and exactly the given environment


def test_an_interpreter_option_the_server_does_not_take_runs_the_real_interpreter(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    status, got = _probe(python(), ["-X", "dev", "probe.py"], tmp_path)
    assert (status, got["executable"], got["warm"]) == (3, sys.executable, False)


SPAWNS = """
import multiprocessing, sys

def square(x):
    return x * x

if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        print(pool.map(square, [1, 2, 3]), sys.executable)
"""


def test_multiprocessing_spawn_under_the_stand_in_works(tmp_path):
    (tmp_path / "spawns.py").write_text(SPAWNS)
    job = subprocess.run([python(), "spawns.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert job.stdout == f"[1, 4, 9] {python()}\n"


def _started(stand_in: str, code: str, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """The stand-in running ``code`` once the program wrote its pid to ``pid``: the stand-in and the pid."""
    process = subprocess.Popen([stand_in, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().endswith("\n"):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.05)
    return process, int((tmp_path / "pid").read_text())


HANDLES_SIGTERM = """
import os, signal, time
signal.signal(signal.SIGTERM, lambda number, frame: os._exit(40 + number))
open("pid", "w").write(f"{os.getpid()}\\n")
time.sleep(60)
"""


def test_a_signal_to_the_stand_in_reaches_the_program_and_its_exit_is_the_stand_ins(tmp_path):
    process, pid = _started(python(), HANDLES_SIGTERM, tmp_path)
    assert pid != process.pid  # forked by the server, not by the stand-in
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 40 + signal.SIGTERM


def test_a_program_killed_by_a_signal_kills_the_stand_in_with_it(tmp_path):
    code = "import os, signal; open('pid', 'w').write(f'{os.getpid()}\\n'); os.kill(os.getpid(), signal.SIGKILL)"
    process = subprocess.Popen([python(), "-c", code], cwd=tmp_path)
    assert process.wait(timeout=60) == -signal.SIGKILL


IGNORES_SIGUSR1_AND_FAILS = """
import os, signal, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
open("pid", "w").write(f"{os.getpid()}\\n")
time.sleep(0.2)
sys.exit(1)
"""


def test_signals_that_reach_the_stand_in_as_its_program_ends_leave_its_exit_status_alone(tmp_path):
    """As Hydra signals every survivor each time a rank fails: signals keep coming while the program exits."""
    for attempt in range(10):
        (tmp_path / "pid").unlink(missing_ok=True)
        process, _ = _started(python(), IGNORES_SIGUSR1_AND_FAILS, tmp_path)
        while process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGUSR1)
            time.sleep(0.0005)
        assert process.returncode == 1, f"attempt {attempt}: the stand-in ended {process.returncode}"


def test_the_relay_passes_a_signal_on_and_ignores_a_program_that_has_already_ended():
    running = subprocess.Popen(["sleep", "30"])
    stand_in.relay_to(running.pid)(signal.SIGTERM, None)
    assert running.wait(timeout=30) == -signal.SIGTERM  # reaped: no process has this pid any more
    stand_in.relay_to(running.pid)(signal.SIGTERM, None)  # raises ProcessLookupError without the guard


def test_a_killed_stand_in_takes_its_program_with_it(tmp_path):
    process, pid = _started(python(), HANDLES_SIGTERM, tmp_path)
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _running(pid):
        assert time.monotonic() < deadline, f"the program {pid} outlived its killed stand-in"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_a_program_that_starts_sys_executable_starts_it_warm_and_mpiexec_ranks_meet(tmp_path):
    nested = "import subprocess, sys; print(subprocess.run([sys.executable, '-c', 'import sys; print(\"torch\" in sys.modules)'], capture_output=True, text=True).stdout.strip())"  # noqa: E501
    assert subprocess.run([python(), "-c", nested], capture_output=True, text=True, timeout=60).stdout == "True\n"
    ranks = "from mpi4py import MPI; world = MPI.COMM_WORLD; print(world.rank, world.allreduce(world.rank + 1))"
    job = subprocess.run([mpiexec(), "-n", "2", python(), "-c", ranks], env=_env({}), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(job.stdout.splitlines()) == ["0 3", "1 3"]
