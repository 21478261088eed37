"""The timing model of the TUN forwarder: when a packet from host i reaches host j (pure, no I/O).

Every host has one uplink and one downlink of ``rate`` bit/s (a store-and-forward switch between them) and
every packet gets a fixed one-way ``delay``. A packet of ``size`` bytes handed over at time ``t``:

1. uplink:   ``u = max(t, up_free[i]) + 8 * size / rate``;  ``up_free[i] = u``
2. downlink: ``d = max(u, down_free[j]) + 8 * size / rate``;  ``down_free[j] = d``
3. delivery at ``d + delay``.

With no rate limit both serialisation terms are 0 and the delivery is at ``t + delay``. The downlink is a
finite FIFO: if the backlog waiting in front of the packet, ``(down_free[j] - u) * rate / 8``, exceeds
``queue_bytes`` the packet is dropped (tail drop), as a switch port with that much buffer would. The
forwarder reads a host's packets only while ``up_free[i] <= now + lookahead`` (see ``uplink_ready_at``), so
the uplink queue stays in the sender's kernel (TUN queue and TCP), like a real NIC's backpressure.
Delivery times per destination are non-decreasing, so the forwarder never reorders a flow.
"""

from __future__ import annotations


class LinkSchedule:
    """Per-host uplink/downlink reservations of a star network (see the module docstring for the math)."""

    __slots__ = ("_down_free", "_up_free", "delay", "queue_bytes", "rate_bps")

    def __init__(self, hosts: int, rate_bps: float | None, delay_s: float, queue_bytes: int) -> None:
        self.rate_bps = rate_bps
        self.delay = delay_s
        self.queue_bytes = queue_bytes
        self._up_free = [0.0] * hosts
        self._down_free = [0.0] * hosts

    def serialisation(self, size: int) -> float:
        """Seconds one link needs to put ``size`` bytes on the wire (0 without a rate limit)."""
        return 0.0 if self.rate_bps is None else 8.0 * size / self.rate_bps

    def uplink_ready_at(self, src: int) -> float:
        """Time at which host ``src``'s uplink has finished everything accepted so far."""
        return self._up_free[src]

    def schedule(self, src: int, dst: int, size: int, now: float) -> float | None:
        """Delivery time of a ``size``-byte packet from ``src`` to ``dst`` handed over at ``now``.

        Returns ``None`` when the destination's downlink queue is full and the packet is dropped.
        """
        wire = self.serialisation(size)
        uplink_done = max(now, self._up_free[src]) + wire
        self._up_free[src] = uplink_done
        backlog_s = self._down_free[dst] - uplink_done
        if self.rate_bps is not None and backlog_s * self.rate_bps / 8.0 > self.queue_bytes:
            return None
        downlink_done = max(uplink_done, self._down_free[dst]) + wire
        self._down_free[dst] = downlink_done
        return downlink_done + self.delay
