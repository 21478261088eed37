"""Launch tests/helpers/failure_dead_peer_worker.py on 4 processes and collect, per rank, its exit status and output.

Gloo: one process per rank with torchrun's environment (helpers.launch.start_worker). MPI: ``mpiexec
-disable-auto-cleanup -print-all-exitcodes -n 4`` (MPICH's Hydra; without the flag Hydra kills every rank as soon as
one dies; a healthy job runs without it); the per-rank status comes from Hydra's "Exit codes" line. A rank's output
is what it wrote to its own standard-error file (tests/helpers/own_stderr.py), after what it wrote before it knew
its rank (Gloo: captured per process).
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from helpers import own_stderr
from helpers.launch import REPO, _env, mpiexec, python, start_gloo_workers, wait_for_all

N = 4
WORKER = REPO / "tests" / "helpers" / "failure_dead_peer_worker.py"


@dataclass
class Job:
    statuses: list[int]  # per rank: exit code, or -signal when killed (MPI: Hydra's waitpid status decoded)
    outputs: list[str]  # per rank
    ended_at: float  # time.time() when the last process had ended


def _hydra_status(raw: int) -> int:
    return -(raw & 0x7F) if raw & 0x7F else raw >> 8


def run(
    backend: str, out_dir: Path, kill_rank: int, steps: int = 30, timeout: float = 90.0, worker: Path = WORKER
) -> Job:
    """Run ``worker`` (OUT_DIR BACKEND KILL_RANK STEPS) on ``N`` processes. ``kill_rank`` -1: a healthy run; else
    a failure is expected (under MPI, ``-disable-auto-cleanup`` keeps the survivors alive to report it)."""
    argv = [python(), str(worker), str(out_dir), backend, str(kill_rank), str(steps)]
    if backend == "mpi":
        # -disable-auto-cleanup only with a failure: Hydra then also signals (SIGUSR1) the ranks still finalizing
        # when the first healthy rank exits, so a healthy job runs as users run it, without the flag.
        keep_survivors = ["-disable-auto-cleanup"] if kill_rank >= 0 else []
        command = [mpiexec(), *keep_survivors, "-print-all-exitcodes", "-n", str(N), *argv]
        proc = subprocess.run(command, env=_env({}), capture_output=True, text=True, timeout=timeout)
        ended_at = time.time()
        codes = re.search(r"Exit codes: \[[^\]]*\] ([\d,]+)", proc.stdout + proc.stderr)
        statuses = [_hydra_status(int(c)) for c in codes.group(1).split(",")] if codes else [proc.returncode] * N
        return Job(statuses, [own_stderr.read(out_dir, r) for r in range(N)], ended_at)
    consoles = [out_dir / f"rank{r}.console" for r in range(N)]
    procs = start_gloo_workers(argv[1:], consoles)
    try:
        wait_for_all(procs, timeout)
    finally:
        ended_at = time.time()
    outputs = [console.read_text() + own_stderr.read(out_dir, rank) for rank, console in enumerate(consoles)]
    return Job([proc.returncode for proc in procs], outputs, ended_at)


def pids(out_dir: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(out_dir.glob("rank*.pid"))]


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, or a process already reaped, does not)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
