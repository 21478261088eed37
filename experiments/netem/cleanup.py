"""Finding and removing what emulated networks left behind: namespaces, the processes in them, forwarders.

A namespace named ``gtn<pid>-<instance>-...`` belongs to the owner process ``pid``. ``cleanup_stale``
removes every such namespace whose owner is no longer alive (or all of them with ``include_alive=True``):
it kills the processes still inside (``ip netns pids``), then deletes the namespace, which destroys its
veth ends, bridge, TUN devices and qdiscs with it. A forwarder whose owner died exits by itself when its
control pipe reaches EOF and has PR_SET_PDEATHSIG; as a last resort ``cleanup_stale`` also kills any
``experiments.netem.forwarder`` process whose ``--owner`` is dead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from experiments.netem.config import PREFIX, owner_of_namespace

FORWARDER_MODULE = "experiments.netem.forwarder"


class NetemCommandError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message has the command and its stderr."""


def run_command(*argv: str) -> str:
    """Run ``argv`` (an ip/tc/sysctl call), return its stdout; raise ``NetemCommandError`` on failure."""
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetemCommandError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def is_alive(pid: int) -> bool:
    """True if a process with this PID exists (zombies count as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of network namespaces (from ``ip netns``) that start with ``prefix``."""
    output = run_command("ip", "-j", "netns", "list").strip()
    return [entry["name"] for entry in json.loads(output or "[]") if entry["name"].startswith(prefix)]


def list_root_links(prefix: str = PREFIX) -> list[str]:
    """Names of network devices in this (the root) namespace that start with ``prefix``."""
    output = run_command("ip", "-j", "link", "show").strip()
    return [entry["ifname"] for entry in json.loads(output or "[]") if entry["ifname"].startswith(prefix)]


def namespace_pids(namespace: str) -> list[int]:
    """PIDs of the processes living in ``namespace`` (empty if it is gone)."""
    try:
        return [int(pid) for pid in run_command("ip", "netns", "pids", namespace).split()]
    except NetemCommandError:
        return []


def kill_and_wait(pids: list[int], grace_s: float, groups: bool = False) -> None:
    """SIGTERM ``pids``, wait up to ``grace_s`` for them to exit, then SIGKILL the survivors.

    With ``groups`` each PID is a session leader we started, and its whole process group is signalled.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace_s > 0 else (signal.SIGKILL,):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if groups:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
        deadline = time.monotonic() + max(grace_s, 1.0)
        while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = [pid for pid in pids if is_alive(pid)]
        if not pids:
            return


def remove_namespaces(namespaces: list[str], grace_s: float = 1.0) -> None:
    """Kill every process inside ``namespaces``, then delete them; errors on one do not stop the others."""
    kill_and_wait([pid for namespace in namespaces for pid in namespace_pids(namespace)], grace_s)
    errors = []
    for namespace in namespaces:
        try:
            run_command("ip", "netns", "delete", namespace)
        except NetemCommandError as error:
            if namespace in list_namespaces(namespace):
                errors.append(str(error))
    if errors:
        raise NetemCommandError("; ".join(errors))


def orphaned_forwarders(include_alive: bool = False) -> list[int]:
    """PIDs of forwarder processes whose owner is dead (or of all forwarders with ``include_alive``)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if FORWARDER_MODULE not in argv or "--owner" not in argv[:-1]:
            continue
        owner = int(argv[argv.index("--owner") + 1])
        if owner != os.getpid() and (include_alive or not is_alive(owner)):
            found.append(int(proc.name))
    return found


def cleanup_stale(include_alive: bool = False) -> list[str]:
    """Remove leftovers of dead owners (of every owner but this process with ``include_alive``).

    Returns the names of the namespaces removed and ``forwarder:<pid>`` for each forwarder killed.
    """
    stale = [
        name
        for name in list_namespaces()
        if (owner := owner_of_namespace(name)) is not None
        and owner != os.getpid()
        and (include_alive or not is_alive(owner))
    ]
    forwarders = orphaned_forwarders(include_alive)
    kill_and_wait(forwarders, grace_s=0.0)
    remove_namespaces(stale, grace_s=0.0)
    return stale + [f"forwarder:{pid}" for pid in forwarders]
