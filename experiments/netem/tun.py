"""Opening Linux TUN devices (IPv4 packets without the 4-byte packet-information header)."""

from __future__ import annotations

import fcntl
import os
import struct

TUNSETIFF = 0x400454CA  # _IOW('T', 202, int), linux/if_tun.h
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_SIZE = 65536  # larger than any IPv4 packet


def open_tun(name_pattern: str = "gtn%d") -> tuple[int, str]:
    """Create a non-persistent TUN device; return (non-blocking fd, kernel-chosen name).

    The device exists only while a file descriptor to it is open, so a dead forwarder leaves none behind.
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        reply = fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name_pattern.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd, reply[:16].rstrip(b"\0").decode()
