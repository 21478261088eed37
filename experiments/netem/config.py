"""Settings of an emulated network: rate parsing, validation, and the names of what gets created.

Everything a network creates is named ``gtn<owner pid>-<instance>-<role>`` (namespaces ``...-h<i>`` for
host i and ``...-sw`` for the switch of the veth mode), so that ``cleanup`` can tell which owner a leftover
belongs to and remove it once that owner is dead. Host i gets the address ``10.77.0.<i + 1>/24`` on a device
called ``eth0`` inside its own namespace; no address outside 10.77.0.0/24 is ever configured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from experiments.rates import RateError, parse_rate

PREFIX = "gtn"
SUBNET = "10.77.0"
PREFIX_LENGTH = 24
DEVICE = "eth0"
MAX_HOSTS = 250
TUN_MTU = 65000
DEFAULT_QUEUE_BYTES = 4 * 2**20

NAMESPACE_PATTERN = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(h\d+|sw)$")


class NetemConfigError(ValueError):
    """A setting of the emulated network is invalid; the message names the setting and the value."""


def parse_rate_limit(rate: str | float | None) -> float | None:
    """A per-host rate limit in bit/s: tc(8) text read by :func:`experiments.rates.parse_rate` (``"1gbit"``,
    ``"100mbit"``, ``"1mbps"`` = 8e6 bit/s), a number of bit/s, or no limit (``None``).

    ``None``, ``0``, ``""``, ``"0"``, ``"none"`` and ``"unlimited"`` mean no limit and return ``None``.
    """
    if rate is None:
        return None
    if isinstance(rate, int | float):
        value = float(rate)
    else:
        if rate.strip().lower() in ("", "none", "0", "unlimited"):
            return None
        try:
            value = parse_rate(rate, unit="bit/s")
        except RateError as err:
            raise NetemConfigError(
                f"rate={rate!r} is not a rate in tc(8) units: write bit/s as '1gbit', '100mbit' or '500kbit' "
                "(or byte/s as '125mbps')"
            ) from err
    if value < 0:
        raise NetemConfigError(f"rate={rate!r} bit/s is negative")
    return value or None


@dataclass(frozen=True)
class NetworkConfig:
    """A validated description of one emulated network.

    ``rate_bps`` limits each host's uplink and downlink (``None`` = unlimited); ``delay_s`` is the one-way
    delay added to every packet (> 0 selects the TUN forwarder); ``queue_bytes`` bounds the forwarder's
    downlink queue per host (tail drop beyond it).
    """

    hosts: int
    rate_bps: float | None = None
    delay_s: float = 0.0
    mtu: int | None = None
    queue_bytes: int = DEFAULT_QUEUE_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or not 2 <= self.hosts <= MAX_HOSTS:
            raise NetemConfigError(f"hosts={self.hosts!r} must be an integer in [2, {MAX_HOSTS}]")
        if self.rate_bps is not None and self.rate_bps < 8e3:
            raise NetemConfigError(f"rate={self.rate_bps!r} bit/s is below the 8 kbit/s minimum")
        if not self.delay_s >= 0.0:
            raise NetemConfigError(f"delay={self.delay_s!r} s must be >= 0")
        if self.mtu is not None and not 576 <= self.mtu <= 65535:
            raise NetemConfigError(f"mtu={self.mtu!r} must be in [576, 65535]")
        if self.queue_bytes < 65536:
            raise NetemConfigError(f"queue_bytes={self.queue_bytes!r} must be >= 65536 (one large packet)")

    @property
    def uses_tun(self) -> bool:
        """A delay needs the userspace forwarder; without one the kernel's veth+bridge+htb path is used."""
        return self.delay_s > 0.0


def address(host: int) -> str:
    """IPv4 address of ``host`` (0-based) inside its namespace."""
    return f"{SUBNET}.{host + 1}"


def host_of_address(packed: bytes) -> int | None:
    """Host index of a packed IPv4 address in 10.77.0.0/24, or ``None`` if it is outside it."""
    if packed[:3] != bytes(int(part) for part in SUBNET.split(".")):
        return None
    return packed[3] - 1 if 1 <= packed[3] <= MAX_HOSTS else None


def network_tag(owner_pid: int, instance: int) -> str:
    """Common name stem of everything one network creates."""
    return f"{PREFIX}{owner_pid}-{instance}"


def host_namespace(tag: str, host: int) -> str:
    return f"{tag}-h{host}"


def switch_namespace(tag: str) -> str:
    return f"{tag}-sw"


def owner_of_namespace(name: str) -> int | None:
    """Owner PID encoded in a namespace name made by this package, else ``None``."""
    match = NAMESPACE_PATTERN.match(name)
    return int(match.group(1)) if match else None
