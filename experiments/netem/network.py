"""``EmulatedNetwork``: N hosts in network namespaces with per-host rate limits and a one-way delay.

Two modes, chosen by the delay:

* ``delay_ms == 0`` -- kernel path. A switch namespace holds a bridge; host i's namespace holds ``eth0``, a
  veth whose peer ``p<i>`` is a bridge port. With a rate, an htb qdisc limits ``eth0`` (host i's uplink)
  and ``p<i>`` (its downlink).
* ``delay_ms > 0`` -- TUN path. Host i's namespace holds ``eth0``, a TUN device (MTU 65000); one forwarder
  process (forwarder.py) moves packets between them and enforces rate and delay (schedule.py).

Needs root (namespaces, devices, qdiscs). Everything is removed on exit from the ``with`` block, on an
exception inside it, on SIGINT/SIGTERM/SIGHUP (handlers turn them into exceptions), at interpreter exit, and
-- after a SIGKILL of the owner -- by the next ``EmulatedNetwork`` or by ``python -m experiments.netem
cleanup`` (see cleanup.py). TUN devices are non-persistent and vanish with the forwarder.

Example::

    with EmulatedNetwork(hosts=2, rate="1gbit", delay_ms=1.0) as net:
        server = net.popen(1, ["python", "server.py", "--bind", net.address(1)])
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from experiments.netem.cleanup import cleanup_stale, kill_and_wait, remove_namespaces, run_command
from experiments.netem.config import (
    DEFAULT_QUEUE_BYTES,
    DEVICE,
    PREFIX_LENGTH,
    TUN_MTU,
    NetworkConfig,
    address,
    host_namespace,
    network_tag,
    parse_rate_limit,
    switch_namespace,
)
from experiments.netem.tun import open_tun

REPO_ROOT = Path(__file__).resolve().parents[2]
_instances = itertools.count()
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class NetemUnavailable(RuntimeError):
    """This machine cannot run an emulated network (not root, missing tools); the message says why."""


def missing_prerequisites(tun: bool = True) -> str | None:
    """Why an emulated network cannot be created here, or ``None`` if it can."""
    if os.geteuid() != 0:
        return "network emulation needs root (network namespaces, veth/TUN devices, tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    if tun and not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing (no TUN support), so delays cannot be emulated"
    return None


def python_path_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: os.environ) with the repository root on PYTHONPATH, so ``experiments`` imports."""
    merged = dict(os.environ if env is None else env)
    merged["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), merged.get("PYTHONPATH")) if p)
    return merged


def _raise_for_signal(signum: int, _frame: object) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


class EmulatedNetwork:
    """Context manager creating ``hosts`` namespaces joined by an emulated network (see module docstring).

    ``rate``: per-host uplink and downlink limit (``"1gbit"``, ``"100mbit"``, bit/s, or ``None``).
    ``delay_ms``: one-way delay added to every packet; > 0 uses the TUN forwarder.
    ``mtu``: device MTU (default: kernel's 1500 for veth, 65000 for TUN).
    ``queue_bytes``: forwarder downlink buffer per host (TUN path only).
    ``realtime_forwarder``: run the forwarder at SCHED_FIFO priority 1 so busy ranks cannot starve it.
    """

    device = DEVICE

    def __init__(
        self,
        hosts: int,
        rate: str | float | None = None,
        delay_ms: float = 0.0,
        mtu: int | None = None,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        realtime_forwarder: bool = True,
    ) -> None:
        self.config = NetworkConfig(hosts, parse_rate_limit(rate), delay_ms / 1000.0, mtu, queue_bytes)
        self.realtime_forwarder = realtime_forwarder
        self.tag = network_tag(os.getpid(), next(_instances))
        self.namespaces = [host_namespace(self.tag, host) for host in range(hosts)]
        self.forwarder: subprocess.Popen | None = None
        self._control_fd: int | None = None
        self._processes: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._saved_handlers: dict[int, object] = {}
        self._open = False

    @property
    def hosts(self) -> int:
        return self.config.hosts

    def address(self, host: int) -> str:
        """IPv4 address of ``host`` on the emulated network."""
        self._check_host(host)
        return address(host)

    def namespace(self, host: int) -> str:
        """Name of ``host``'s network namespace (for ``ip netns exec``)."""
        self._check_host(host)
        return self.namespaces[host]

    def exec_prefix(self, host: int) -> list[str]:
        """argv prefix that runs a command inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def popen(
        self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace (own session); it is killed when the network closes."""
        if not self._open:
            raise RuntimeError(f"network {self.tag} is not open; use it inside `with EmulatedNetwork(...)`")
        process = subprocess.Popen(
            [*self.exec_prefix(host), *argv],
            env=None if env is None else dict(env),
            start_new_session=True,
            **kwargs,
        )
        self._processes.append(process)
        return process

    def __enter__(self) -> EmulatedNetwork:
        reason = missing_prerequisites(tun=self.config.uses_tun)
        if reason is not None:
            raise NetemUnavailable(reason)
        cleanup_stale()
        self._install_signal_handlers()
        atexit.register(self.close)
        self._open = True
        try:
            self._create_namespaces()
            if self.config.uses_tun:
                self._create_tun_hosts()
            else:
                self._create_bridge_hosts()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill this network's processes, stop the forwarder, delete its namespaces. Idempotent."""
        if not self._open:
            return
        in_main_thread = threading.current_thread() is threading.main_thread()
        if in_main_thread:  # a second Ctrl-C must not interrupt the teardown half-way
            for signum in _HANDLED_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        try:
            kill_and_wait([p.pid for p in self._processes if p.poll() is None], grace_s=1.0, groups=True)
            for process in self._processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=1.0)
            self._stop_forwarder()
            remove_namespaces(self._created, grace_s=1.0)
            self._created = []
        finally:
            self._open = False
            atexit.unregister(self.close)
            if in_main_thread:
                for signum, handler in self._saved_handlers.items():
                    signal.signal(signum, handler)
            self._saved_handlers = {}

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise IndexError(f"host={host} is out of range for a network of {self.hosts} hosts")

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _HANDLED_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._saved_handlers[signum] = previous
            if signum != signal.SIGINT or previous is not signal.default_int_handler:
                signal.signal(signum, _raise_for_signal)

    def _create_namespaces(self) -> None:
        names = self.namespaces if self.config.uses_tun else [switch_namespace(self.tag), *self.namespaces]
        for name in names:
            run_command("ip", "netns", "add", name)
            self._created.append(name)
            run_command("ip", "-n", name, "link", "set", "lo", "up")
            run_command("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")

    def _configure_host_device(self, host: int, mtu: int | None) -> None:
        namespace = self.namespaces[host]
        if mtu is not None:
            run_command("ip", "-n", namespace, "link", "set", DEVICE, "mtu", str(mtu))
        run_command("ip", "-n", namespace, "addr", "add", f"{address(host)}/{PREFIX_LENGTH}", "dev", DEVICE)
        run_command("ip", "-n", namespace, "link", "set", DEVICE, "up")

    def _create_bridge_hosts(self) -> None:
        switch = switch_namespace(self.tag)
        run_command("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        run_command("ip", "-n", switch, "link", "set", "br0", "up")
        for host, namespace in enumerate(self.namespaces):
            port = f"p{host}"
            run_command(
                "ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", DEVICE,
                "netns", namespace,
            )  # fmt: skip
            if self.config.mtu is not None:
                run_command("ip", "-n", switch, "link", "set", port, "mtu", str(self.config.mtu))
            run_command("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            self._configure_host_device(host, self.config.mtu)
            if self.config.rate_bps is not None:
                self._install_htb(namespace, DEVICE)
                self._install_htb(switch, port)

    def _install_htb(self, namespace: str, device: str) -> None:
        """Root htb with one default class at the configured rate (burst: 1 ms of traffic, >= 64 KiB)."""
        rate = f"{int(self.config.rate_bps)}bit"
        burst = str(max(65536, int(self.config.rate_bps / 8 / 1000)))
        run_command("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb",
                    "default", "1")  # fmt: skip
        run_command("tc", "-n", namespace, "class", "add", "dev", device, "parent", "1:", "classid", "1:1",
                    "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)  # fmt: skip

    def _create_tun_hosts(self) -> None:
        tun_fds: list[int] = []
        try:
            for host, namespace in enumerate(self.namespaces):
                fd, name = open_tun()
                tun_fds.append(fd)
                run_command("ip", "link", "set", "dev", name, "netns", namespace)
                run_command("ip", "-n", namespace, "link", "set", "dev", name, "name", DEVICE)
                self._configure_host_device(host, self.config.mtu or TUN_MTU)
            self._start_forwarder(tun_fds)
        finally:
            for fd in tun_fds:  # the forwarder holds its own copies; the devices live as long as it does
                os.close(fd)

    def _start_forwarder(self, tun_fds: list[int]) -> None:
        control_read, self._control_fd = os.pipe()
        argv = [
            sys.executable, "-m", "experiments.netem.forwarder",
            "--owner", str(os.getpid()),
            "--tun-fds", ",".join(map(str, tun_fds)),
            "--control-fd", str(control_read),
            "--rate-bps", str(self.config.rate_bps or 0.0),
            "--delay-s", repr(self.config.delay_s),
            "--queue-bytes", str(self.config.queue_bytes),
        ]  # fmt: skip
        if self.realtime_forwarder:
            argv.append("--realtime")
        try:
            self.forwarder = subprocess.Popen(
                argv, pass_fds=(*tun_fds, control_read), env=python_path_env(), start_new_session=True
            )
        finally:
            os.close(control_read)

    def _stop_forwarder(self) -> None:
        if self._control_fd is not None:
            os.close(self._control_fd)  # EOF tells the forwarder to exit
            self._control_fd = None
        if self.forwarder is not None:
            try:
                self.forwarder.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.forwarder.kill()
                self.forwarder.wait()
            self.forwarder = None
