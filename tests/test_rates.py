"""experiments.rates.parse_rate: one reader of tc(8) rates, in the unit its caller names."""

from __future__ import annotations

import pytest

from experiments.rates import BITS_PER_BYTE, UNITS, RateError, parse_rate


@pytest.mark.parametrize(
    ("text", "bits_per_second"),
    [("1gbit", 1e9), ("100mbit", 1e8), ("500kbit", 5e5), ("1.5 Gbit", 1.5e9), ("1mbps", 8e6), ("10gbps", 8e10)],
)
def test_tc_units(text: str, bits_per_second: float) -> None:
    assert parse_rate(text, unit="bit/s") == pytest.approx(bits_per_second)
    assert parse_rate(text, unit="byte/s") == pytest.approx(bits_per_second / 8)


@pytest.mark.parametrize("suffix", UNITS)
def test_the_two_units_differ_by_eight_for_every_suffix(suffix: str) -> None:
    text = f"3{suffix}"
    assert parse_rate(text, unit="bit/s") == BITS_PER_BYTE * parse_rate(text, unit="byte/s")


def test_bps_is_bytes_and_bit_is_bits() -> None:
    assert parse_rate("1kbps", unit="byte/s") == parse_rate("8kbit", unit="byte/s") == 1e3


@pytest.mark.parametrize("text", ["1000", "fast", "1 gigabit", "", "-1gbit"])
def test_text_without_a_tc_unit_is_refused_naming_it_and_the_units(text: str) -> None:
    with pytest.raises(RateError, match=rf"rate {text!r} needs a number and a tc\(8\) unit: bit/s as bit, kbit"):
        parse_rate(text, unit="bit/s")


def test_an_unknown_unit_argument_is_refused() -> None:
    with pytest.raises(ValueError, match="unit must be 'bit/s' or 'byte/s'"):
        parse_rate("1gbit", unit="Gbit/s")  # type: ignore[arg-type]
