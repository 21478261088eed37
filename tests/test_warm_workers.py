"""A worker forked from the warm server (tests/helpers/warm_workers.py) is, to its script, ``python SCRIPT ARGS``:
its own environment, arguments, ``sys.path[0]``, working directory and output; its exit status; atexit handlers and
the script's globals alive until the interpreter's end; a signal's death reported as ``Popen`` reports it."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from helpers.launch import _env, start_worker

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
