"""The spectral gap is 1 - |lambda_2(W)| for every W (issue 31), in analysis, report and both CLI commands.

For a symmetric W it is 1 - rho = 1 - ||W - J||_2 (docs/design.md F.3); for a row-stochastic W that is not
symmetric ||W - J||_2 can exceed 1 (uniform star of 8: 1.06), and 1 - rho went negative. The eigenvalue form lies
in [0, 1] for every stochastic W and equals 1 - rho whenever W is normal (symmetric or circulant).
"""

import math

import numpy as np
import pytest

import topologies
from topologies import analysis
from topologies.__main__ import main
from topologies.report import summarize


def test_uniform_star_gap_is_one_minus_its_second_eigenvalue_modulus_one_half():
    # Leaves i, j: W (e_i - e_j) = (e_i - e_j) / 2, so lambda = 1/2 with multiplicity n - 2; the last one is
    # trace - 1 - (n - 2)/2 = 1/n - 1/2 = -3/8 for n = 8.
    w = topologies.star(8, weights="uniform").mixing_matrix(0)
    assert topologies.rho(w) > 1
    assert topologies.spectral_gap(w) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("weights", ["uniform", "metropolis"])
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16, 33])
def test_gap_of_every_stochastic_w_lies_in_zero_one(n, weights):
    for w in (
        topologies.star(n, weights).mixing_matrix(0),
        topologies.erdos_renyi(n, 0.7, 3, weights).mixing_matrix(0),
    ):
        assert 0.0 <= topologies.spectral_gap(w) <= 1.0


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("name", ["ring", "torus", "hypercube", "random_regular", "star", "complete"])
def test_gap_of_a_symmetric_w_is_one_minus_rho(name, n):
    w = topologies.by_name(name, n).mixing_matrix(0)
    assert topologies.spectral_gap(w) == pytest.approx(1 - topologies.rho(w), abs=1e-12)


@pytest.mark.parametrize("n", [8, 16, 32])
def test_gap_of_the_directed_circulant_static_exponential_is_one_minus_rho(n):
    w = topologies.static_exponential(n).mixing_matrix(0)
    assert topologies.spectral_gap(w) == pytest.approx(2 / (1 + math.log2(n)), abs=1e-12)


def test_gap_of_a_disconnected_step_is_zero():
    assert topologies.spectral_gap(topologies.one_peer_hypercube(8).mixing_matrix(0)) == pytest.approx(0, abs=1e-12)


def test_step_gaps_cover_one_period():
    gaps = analysis.step_gaps(topologies.one_peer_exponential(16))
    assert gaps == pytest.approx([1 - math.cos(math.pi / 16), 0, 0, 0], abs=1e-12)


def test_summary_carries_the_same_gaps():
    schedule = topologies.star(8, weights="uniform")
    assert summarize(schedule).step_gaps == pytest.approx([0.5], abs=1e-12)


def test_describe_prints_the_gap_of_a_non_symmetric_w(capsys):
    assert main(["describe", "star", "-n", "8", "--weights", "uniform"]) == 0
    out = capsys.readouterr().out
    assert "gap per step        0.5000" in out
    assert "1 - |lambda_2(W)|" in out


def test_compare_tabulates_the_gap_per_step(capsys):
    assert main(["compare", "-n", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line.split("  ") for line in lines if line.startswith("schedule"))
    column = [cell.strip() for cell in header if cell.strip()].index("min gap/step")
    rows = {
        line.split()[0]: line.split() for line in lines if line.split()[:1] and line.split()[0] in topologies.names()
    }
    assert rows["ring"][column] == f"{1 - 0.9493:.4f}"
    assert rows["one_peer_hypercube"][column] == "0.0000"
    assert all(0 <= float(row[column]) <= 1 for row in rows.values())


def test_gap_of_a_matrix_that_is_not_row_stochastic_is_refused_saying_what_it_needs():
    with pytest.raises(topologies.ScheduleError, match=r"spectral_gap needs a square row-stochastic W"):
        topologies.spectral_gap(np.array([[0.5, 0.4], [0.5, 0.5]]))
