"""Link rates written in tc(8) notation, read in the unit the caller names.

tc(8) suffixes: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are *bits* per second; ``bps``, ``kbps``,
``mbps``, ``gbps``, ``tbps`` are *bytes* per second (so ``"1mbps"`` is 8 Mbit/s). Prefixes are decimal (k = 1e3).
The emulated network (:mod:`experiments.netem`) configures links in bit/s; the runtime model
(:mod:`experiments.runtime_model`) computes transfer times in byte/s. Both read rates here, naming the unit they
want, so "1gbit" is 1e9 bit/s = 1.25e8 byte/s everywhere.
"""

from __future__ import annotations

import re
from typing import Literal

RateUnit = Literal["bit/s", "byte/s"]
BITS_PER_BYTE = 8

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kmgt]?)(bit|bps)\s*", re.IGNORECASE)
#: Bits in one of each tc base unit: "bit" is one bit, "bps" one byte.
_BITS = {"bit": 1.0, "bps": float(BITS_PER_BYTE)}
UNITS = tuple(prefix + base for base in _BITS for prefix in _PREFIX)


class RateError(ValueError):
    """A rate is not in tc(8) notation; the message names the text and the units accepted."""


def parse_rate(text: str, unit: RateUnit) -> float:
    """The rate ``text`` in tc(8) notation (e.g. ``"1gbit"``, ``"100mbit"``, ``"10gbps"``), in ``unit``.

    ``unit="bit/s"`` returns bits per second, ``unit="byte/s"`` bytes per second; the two differ by a factor 8:
    ``parse_rate(t, "bit/s") == 8 * parse_rate(t, "byte/s")``. A number without a unit is refused (tc would read
    bits, a byte/s reader bytes): the unit is always written.
    """
    if unit not in ("bit/s", "byte/s"):
        raise ValueError(f"unit must be 'bit/s' or 'byte/s', got {unit!r}")
    match = _PATTERN.fullmatch(text)
    if match is None:
        raise RateError(
            f"rate {text!r} needs a number and a tc(8) unit: bit/s as {', '.join(UNITS[:5])}, or byte/s as "
            f"{', '.join(UNITS[5:])} (e.g. '1gbit' = 1e9 bit/s)"
        )
    number, prefix, base = match.groups()
    bits_per_second = float(number) * _PREFIX[prefix.lower()] * _BITS[base.lower()]
    return bits_per_second if unit == "bit/s" else bits_per_second / BITS_PER_BYTE
