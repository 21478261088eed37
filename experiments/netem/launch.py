"""Launching one training process per emulated host, for torch.distributed (Gloo) or MPI (MPICH's mpiexec).

Gloo: one process per host namespace with the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK=0,
LOCAL_WORLD_SIZE=1, MASTER_ADDR = host 0's address, MASTER_PORT) and GLOO_SOCKET_IFNAME set to the
namespace's device, so Gloo advertises the emulated address rather than 127.0.0.1.

MPI: an MPMD ``mpiexec -n 1 ip netns exec <ns0> env FI_TCP_IFACE=eth0 argv : -n 1 ...`` with
MPIR_CVAR_NOLOCAL=1 (else MPICH uses shared memory and bypasses the network), MPIR_CVAR_CH4_NETMOD=ofi and
FI_PROVIDER=tcp.

Output lines are prefixed with ``[rank] `` (Gloo) or ``[mpi] `` (MPI: Hydra's ``-prepend-rank`` splits
lines at arbitrary chunk boundaries, so the ranks' own lines are passed through whole instead). The result
is the largest exit code (a process killed by signal s counts as 128 + s, a timeout as 124). When one
process fails or the timeout passes, all are killed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from experiments.netem.cleanup import kill_and_wait
from experiments.netem.network import EmulatedNetwork, python_path_env

TIMEOUT_EXIT_CODE = 124
MPI_ENV = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
}

LineSink = Callable[[str], None]


def _print_line(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def gloo_env(net: EmulatedNetwork, rank: int, master_port: int, base: Mapping[str, str]) -> dict[str, str]:
    """Environment of Gloo rank ``rank`` on host ``rank``, as torchrun sets it for one process per host."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(net.hosts),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        MASTER_ADDR=net.address(0),
        MASTER_PORT=str(master_port),
        GLOO_SOCKET_IFNAME=net.device,
        TP_SOCKET_IFNAME=net.device,
    )
    return env


def mpiexec_argv(net: EmulatedNetwork, argv: Sequence[str], mpiexec: str | None = None) -> list[str]:
    """MPMD command line running ``argv`` once in every host namespace, rank r on host r."""
    mpiexec = mpiexec or find_mpiexec()
    command = [mpiexec]
    for host in range(net.hosts):
        if host:
            command.append(":")
        settings = [f"{key}={value}" for key, value in {**MPI_ENV, "FI_TCP_IFACE": net.device}.items()]
        command += ["-n", "1", *net.exec_prefix(host), "env", *settings, *argv]
    return command


def find_mpiexec() -> str:
    """``mpiexec`` next to this Python (the mpich wheel puts it there), else the one on PATH."""
    candidate = Path(sys.executable).with_name("mpiexec")
    found = str(candidate) if candidate.exists() else shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no `mpiexec` next to the Python executable or on PATH; pip install mpich")
    return found


def _stream(process: subprocess.Popen, prefix: str, sink: LineSink) -> None:
    for line in process.stdout:
        sink(f"{prefix}{line}")


def supervise(
    processes: Sequence[subprocess.Popen], prefixes: Sequence[str], timeout_s: float | None, sink: LineSink
) -> int:
    """Stream output and wait; kill all at the first failure or the timeout; return the max exit code."""
    readers = [
        threading.Thread(target=_stream, args=(process, prefix, sink), daemon=True)
        for process, prefix in zip(processes, prefixes, strict=True)
    ]
    for reader in readers:
        reader.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    timed_out = False
    while any(process.poll() is None for process in processes):
        failed = any(process.returncode not in (None, 0) for process in processes)
        timed_out = deadline is not None and time.monotonic() > deadline
        if failed or timed_out:
            if timed_out:
                sink(f"netem: timeout after {timeout_s} s, killing all ranks\n")
            kill_and_wait([p.pid for p in processes if p.poll() is None], grace_s=1.0, groups=True)
            break
        time.sleep(0.05)
    for process in processes:
        process.wait()
    for reader in readers:
        reader.join(timeout=1.0)
    code = max(_exit_code(process.returncode) for process in processes)
    return max(code, TIMEOUT_EXIT_CODE) if timed_out else code


def run_gloo(
    net: EmulatedNetwork,
    argv: Sequence[str],
    master_port: int = 29500,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    sink: LineSink = _print_line,
) -> int:
    """Run ``argv`` as Gloo rank r on host r for every host; return the largest exit code."""
    base = python_path_env(env)
    processes = [
        net.popen(
            rank,
            argv,
            env=gloo_env(net, rank, master_port, base),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(net.hosts)
    ]
    return supervise(processes, [f"[{rank}] " for rank in range(net.hosts)], timeout_s, sink)


def run_mpi(
    net: EmulatedNetwork,
    argv: Sequence[str],
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    sink: LineSink = _print_line,
) -> int:
    """Run ``argv`` as MPI rank r on host r (MPMD mpiexec); return mpiexec's exit code."""
    full_env = {**python_path_env(env), **MPI_ENV}
    process = subprocess.Popen(
        mpiexec_argv(net, argv),
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=os.getcwd(),
    )
    try:
        return supervise([process], ["[mpi] "], timeout_s, sink)
    finally:
        if process.poll() is None:
            kill_and_wait([process.pid], grace_s=1.0, groups=True)
