"""Start a worker script on N real processes (Gloo with torchrun's environment, or ``mpiexec -n N``).

The workers write ``rank{r}.pt`` into ``out_dir``; :func:`launch` returns those results in rank order and fails
with every rank's output when a process exits non-zero or the job outlives its timeout. :func:`run_main_job` runs
``python -m gossip`` (which spawns its own workers) and :func:`metrics_rows` reads its run directory's metrics.csv.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from helpers.warm_workers import WarmWorker, warm_python

REPO = Path(__file__).resolve().parent.parent.parent


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found: pip install -e '.[test]' installs the mpich wheel")
    return found


#: for a job that must run on the CPU also where the host has GPUs (Gloo and MPI jobs whose backend is "auto",
#: which picks NCCL where a GPU is visible, and several ranks cannot share one)
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    # the repository first; an inherited PYTHONPATH (packages carried beside the environment) after it
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}, **extra)
    return env


def cold_start() -> bool:
    """Whether the tests' processes start from scratch (``GOSSIP_TEST_COLD_START=1``) instead of warm."""
    return os.environ.get("GOSSIP_TEST_COLD_START") == "1"


def python() -> str:
    """The interpreter to give ``mpiexec``, a launcher or torchrun: the warm server's stand-in for ``python``
    (:func:`helpers.warm_workers.warm_python`: the program runs forked from the session's warm Python, and so do
    the processes it starts with ``sys.executable``), or ``sys.executable`` with ``GOSSIP_TEST_COLD_START=1``."""
    return sys.executable if cold_start() else warm_python(_env({}))


def start_worker(argv: list[str], extra: dict[str, str], output: Path) -> Any:
    """``python argv[0] argv[1:]`` with :func:`_env` and ``extra``, its output (stdout and stderr) to ``output``.

    The worker is forked from the session's warm Python (:mod:`helpers.warm_workers`: torch and this repository
    imported once, so what torch reads from the environment at import comes from :func:`_env` alone, as for every
    worker here); with ``GOSSIP_TEST_COLD_START=1`` it starts from scratch instead. Returns a handle with
    ``pid``, ``poll()``, ``wait(timeout)``, ``kill()`` and ``returncode``.
    """
    if cold_start():
        with open(output, "w") as console:
            return subprocess.Popen([sys.executable, *argv], env=_env(extra), stdout=console, stderr=subprocess.STDOUT)
    return WarmWorker(argv, _env(extra), output, base_env=_env({}))


def start_gloo_workers(argv: list[str], consoles: list[Path], local_size: int | None = None) -> list[Any]:
    """One worker per console (rank r writes ``consoles[r]``), each ``python argv[0] argv[1:]`` with torchrun's
    environment on a free loopback port; ``local_size`` emulates nodes: LOCAL_RANK = r % local_size (default one)."""
    n, port = len(consoles), str(_free_port())
    local_size = n if local_size is None else local_size
    place = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return [
        start_worker(argv, {"RANK": str(r), "LOCAL_RANK": str(r % local_size), **place}, console)
        for r, console in enumerate(consoles)
    ]


def wait_for_all(procs: list[Any], timeout: float) -> None:
    """Wait until every worker ended, within ``timeout`` seconds in all; past it, kill those still running and raise
    ``subprocess.TimeoutExpired``."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise


def launch(
    script: str,
    out_dir: Path,
    args: list[str],
    *,
    backend: str,
    n: int = 4,
    timeout: float = 240.0,
    local_size: int | None = None,
) -> tuple[list[Any], str]:
    """Run ``tests/helpers/<script>`` on ``n`` processes with ``backend`` ("gloo" or "mpi"); return results and output.

    ``local_size`` (Gloo only) emulates nodes of that many ranks: LOCAL_RANK = r % local_size (default: one node).
    """
    argv = [python(), str(REPO / "tests" / "helpers" / script), str(out_dir), *args]
    if backend == "mpi":
        procs = [
            subprocess.Popen(
                [mpiexec(), "-n", str(n), *argv],
                env=_env({}),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        ]
        try:
            outputs = [procs[0].communicate(timeout=timeout)[0].decode(errors="replace")]
        except subprocess.TimeoutExpired:
            procs[0].kill()
            raise AssertionError(f"{backend} job {script} did not finish within {timeout} s") from None
    else:
        consoles = [out_dir.parent / f"{out_dir.name}.rank{r}.console" for r in range(n)]
        procs = start_gloo_workers(argv[1:], consoles, local_size)
        try:
            wait_for_all(procs, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{backend} job {script} did not finish within {timeout} s") from None
        outputs = [console.read_text(errors="replace") for console in consoles]
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if failed or "terminate called" in "".join(outputs):
        raise AssertionError(f"{backend} job {script} failed or crashed at exit:\n" + "\n".join(outputs))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(n)], "\n".join(outputs)


def results_on_backend(worker: str, backend: str, tmp_path_factory: Any, n: int = 4) -> tuple[str, list[Any]]:
    """``backend`` and the per-rank results of ``tests/helpers/<worker>`` run on it with ``[backend]`` as its
    argument (the scenario worker's convention), in a fresh temporary directory: a module fixture's body."""
    return backend, launch(worker, tmp_path_factory.mktemp(backend), [backend], backend=backend, n=n)[0]


def run_main_job(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m gossip ARGS`` in ``cwd`` with the repository importable; output captured, not checked."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [python(), "-m", "gossip", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def main_job_run(parent: Path, args: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m gossip ARGS --out PARENT/run`` in ``parent``: the finished process and its run directory."""
    out = parent / "run"
    return run_main_job([*args, "--out", str(out)], parent), out


def completed_rows(result: subprocess.CompletedProcess, run_dir: Path, steps: int) -> list[dict[str, str]]:
    """The metrics.csv rows of a run, asserting first that it exited 0 with one row per step, in order, each with a
    finite mean loss."""
    assert result.returncode == 0, result.stdout + result.stderr
    rows = metrics_rows(run_dir)
    assert [int(row["step"]) for row in rows] == list(range(steps))
    assert all(math.isfinite(float(row["mean_loss"])) for row in rows), rows
    return rows


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    """The rows of a main-job run directory's metrics.csv, as strings."""
    with open(run_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


#: the device of the one-GPU tests that run a worker of their own: ``GOSSIP_TEST_DEVICE`` (``cpu`` checks them
#: without a GPU), else ``cuda``
TEST_DEVICE = os.environ.get("GOSSIP_TEST_DEVICE", "cuda")


def device_job(script: str, folder: Path) -> Any:
    """``python tests/helpers/<script> TEST_DEVICE OUT`` in ``folder``, asserting it exits 0; what it saved to OUT."""
    out = folder / "results.pt"
    command = [python(), str(REPO / "tests" / "helpers" / script), TEST_DEVICE, str(out)]
    job = subprocess.run(command, cwd=folder, env=_env({}), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    return torch.load(out, weights_only=False)
