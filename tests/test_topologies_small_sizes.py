"""Every built-in at the smallest sizes (issue 31): hypercube(2) builds, and ``compare -n N`` succeeds for small N."""

import subprocess
import sys

import numpy as np
import pytest

import topologies
from topologies.__main__ import main


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_hypercube_builds_for_every_power_of_two_including_one_and_two(n):
    schedule = topologies.hypercube(n)
    dims = n.bit_length() - 1
    expected = np.zeros((n, n))
    for i in range(n):
        expected[i, i] = 1 / (dims + 1)
        for k in range(dims):
            expected[i, i ^ (1 << k)] = 1 / (dims + 1)
    np.testing.assert_array_equal(schedule.mixing_matrix(0), expected)


def test_hypercube_of_two_is_the_pair_average():
    np.testing.assert_array_equal(topologies.hypercube(2).mixing_matrix(0), np.full((2, 2), 0.5))


@pytest.mark.parametrize("n", range(1, 10))
def test_compare_succeeds_at_small_n(n, capsys):
    assert main(["compare", "-n", str(n)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "hypercube" in captured.out


def test_compare_two_as_a_program_exits_zero_with_nothing_on_stderr():
    result = subprocess.run([sys.executable, "-m", "topologies", "compare", "-n", "2"], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (0, "")
    assert next(line for line in result.stdout.splitlines() if line.startswith("hypercube "))
