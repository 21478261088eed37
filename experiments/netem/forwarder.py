"""Userspace packet forwarder between TUN devices: adds rate limits and a one-way delay (no netem here).

One process owns one TUN device per host namespace. It reads IPv4 packets from host i's device, asks
``LinkSchedule`` when each reaches its destination j (serialisation on i's uplink and j's downlink plus the
fixed delay, see schedule.py), keeps them in a heap and writes each to j's device when due.

It sleeps in ``select`` until the next packet is readable, the next delivery is due, or a paused uplink may be
read again, so it uses no CPU when idle. ``selectors.SelectSelector`` is used rather than epoll on purpose:
epoll's timeout has millisecond resolution, select's has microseconds, and the delays emulated here are
around a millisecond. It exits when its control pipe reaches EOF (the owner died or closed it) or on SIGTERM.

Started by ``EmulatedNetwork`` as ``python -m experiments.netem.forwarder``; not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import heapq
import os
import selectors
import signal
import sys
import time

from experiments.netem.config import host_of_address
from experiments.netem.schedule import LinkSchedule
from experiments.netem.tun import READ_SIZE

LOOKAHEAD_S = 0.0005  # read ahead of the uplink by this much so it never idles between wake-ups
BATCH = 16  # packets read from one device per wake-up before others get a turn
PR_SET_PDEATHSIG = 1


class Forwarder:
    """The event loop: TUN fds in host order, a control fd, and the link schedule."""

    def __init__(self, tun_fds: list[int], control_fd: int, schedule: LinkSchedule) -> None:
        self.tun_fds = tun_fds
        self.control_fd = control_fd
        self.schedule = schedule
        self.selector = selectors.SelectSelector()
        self.pending: list[tuple[float, int, int, bytes]] = []  # (due, sequence, destination, packet)
        self.paused: dict[int, float] = {}  # host -> time its uplink may be read again
        self.sequence = 0
        self.forwarded_packets = 0
        self.forwarded_bytes = 0
        self.dropped_packets = 0

    def run(self) -> None:
        self.selector.register(self.control_fd, selectors.EVENT_READ, None)
        for host, fd in enumerate(self.tun_fds):
            self.selector.register(fd, selectors.EVENT_READ, host)
        while True:
            now = time.monotonic()
            self._deliver_due(now)
            self._resume_uplinks(now)
            deadline = min(
                self.pending[0][0] if self.pending else float("inf"),
                min(self.paused.values(), default=float("inf")),
            )
            timeout = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    if not os.read(self.control_fd, 64):
                        return
                else:
                    self._read_host(key.data)

    def _deliver_due(self, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            _, _, destination, packet = heapq.heappop(self.pending)
            self._write(destination, packet)

    def _resume_uplinks(self, now: float) -> None:
        for host, resume_at in list(self.paused.items()):
            if resume_at <= now:
                del self.paused[host]
                self.selector.register(self.tun_fds[host], selectors.EVENT_READ, host)

    def _read_host(self, host: int) -> None:
        fd = self.tun_fds[host]
        for _ in range(BATCH):
            now = time.monotonic()
            busy_until = self.schedule.uplink_ready_at(host)
            if busy_until > now + LOOKAHEAD_S:
                self.selector.unregister(fd)
                self.paused[host] = busy_until - LOOKAHEAD_S
                return
            try:
                packet = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return
            destination = host_of_address(packet[16:20]) if packet and packet[0] >> 4 == 4 else None
            if destination is None or destination >= len(self.tun_fds) or destination == host:
                self.dropped_packets += 1
                continue
            due = self.schedule.schedule(host, destination, len(packet), now)
            if due is None:
                self.dropped_packets += 1
            elif due <= now and not self.pending:
                self._write(destination, packet)
            else:
                heapq.heappush(self.pending, (due, self.sequence, destination, packet))
                self.sequence += 1

    def _write(self, destination: int, packet: bytes) -> None:
        try:
            os.write(self.tun_fds[destination], packet)
        except OSError:
            self.dropped_packets += 1
            return
        self.forwarded_packets += 1
        self.forwarded_bytes += len(packet)


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tun-fds", required=True, help="comma-separated inherited TUN fds, host order")
    parser.add_argument("--control-fd", type=int, required=True, help="read end of the owner's pipe")
    parser.add_argument("--owner", type=int, required=True, help="PID of the owning process (for cleanup)")
    parser.add_argument("--rate-bps", type=float, default=0.0, help="per-host rate, 0 = unlimited")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--queue-bytes", type=int, required=True)
    parser.add_argument("--realtime", action="store_true", help="SCHED_FIFO priority 1 if permitted")
    args = parser.parse_args(argv)

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when to stop on Ctrl-C
    signal.signal(signal.SIGTERM, _raise_system_exit)
    if args.realtime:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    tun_fds = [int(fd) for fd in args.tun_fds.split(",")]
    schedule = LinkSchedule(len(tun_fds), args.rate_bps or None, args.delay_s, args.queue_bytes)
    forwarder = Forwarder(tun_fds, args.control_fd, schedule)
    try:
        forwarder.run()
    finally:
        print(
            f"netem forwarder (owner {args.owner}): forwarded {forwarder.forwarded_packets} packets "
            f"({forwarder.forwarded_bytes} bytes), dropped {forwarder.dropped_packets}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
