"""Launch errors of a Gloo job started by hand (torchrun's variables without its agent) end within the timeout on
every rank, each naming the cause (tests/helpers/rendezvous_worker.py, timeout 3 s)."""

from __future__ import annotations

import socket
import subprocess

import pytest
from helpers.launch import REPO, _env, _free_port, python

TIMEOUT = 3.0
pytestmark = pytest.mark.multiprocess


def job(ranks: list[int], sizes: list[int], port: int) -> list[tuple[int, str]]:
    """(exit status, output) per process started with RANK/WORLD_SIZE from ``ranks``/``sizes``."""
    command = [python(), str(REPO / "tests" / "helpers" / "rendezvous_worker.py"), str(TIMEOUT)]
    processes = [
        subprocess.Popen(
            command,
            env=_env(
                {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, size in zip(ranks, sizes, strict=True)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    return [(process.returncode, output) for process, output in zip(processes, outputs, strict=True)]


def last_error(output: str) -> str:
    return [line for line in output.splitlines() if line.startswith("gossip.errors.LaunchError: ")][-1]


def test_a_master_port_held_by_another_program_fails_every_rank_naming_the_port():
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()  # accepts connections, never answers
        port = stranger.getsockname()[1]
        (status0, out0), (status1, out1) = job([0, 1], [2, 2], port)
    assert (status0, status1) == (1, 1), out0 + out1
    assert f"rank 0: cannot serve the rendezvous at 127.0.0.1:{port} (" in last_error(out0)
    assert "another program probably holds that port: choose a free MASTER_PORT" in last_error(out0)
    assert last_error(out1) == (
        f"gossip.errors.LaunchError: rank 1: no rendezvous with rank 0 at 127.0.0.1:{port} within 3 s. Rank 0 did "
        "not start its store there (see its output), or another program holds that port: choose a free MASTER_PORT"
    )


def test_two_processes_with_the_same_rank_are_named_on_every_rank():
    port = _free_port()
    results = job([0, 1, 1], [3, 3, 3], port)
    assert [status for status, _ in results] == [1, 1, 1], "\n".join(out for _, out in results)
    cause = (
        f"rank 1: another process already joined the rendezvous at 127.0.0.1:{port} as rank 1: two processes "
        "have RANK=1; give each process its own RANK in [0, 3)"
    )
    for _, output in results:
        assert last_error(output).endswith(cause), output


def test_a_world_size_that_differs_between_processes_is_named_on_every_rank():
    results = job([0, 1], [2, 3], _free_port())
    assert [status for status, _ in results] == [1, 1], "\n".join(out for _, out in results)
    cause = "rank 0: WORLD_SIZE differs between processes: this rank has 2, but rank 1 has 3"
    for _, output in results:
        assert cause in last_error(output), output


def test_a_healthy_job_joins():
    results = job([0, 1], [2, 2], _free_port())
    assert [(status, "joined 2" in output) for status, output in results] == [(0, True), (0, True)], results
