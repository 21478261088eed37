"""``python -m topologies describe`` / ``compare`` and the registry shared with the training CLI."""

import subprocess
import sys

import pytest

import topologies
from topologies.__main__ import main


def _row(output: str, name: str) -> list[str]:
    return next(line.split() for line in output.splitlines() if line.split()[:1] == [name])


def test_names_lists_every_built_in_once():
    assert len(set(topologies.names())) == len(topologies.names()) == 15


@pytest.mark.parametrize("name", topologies.names())
def test_every_registered_name_builds_at_n_16(name):
    schedule = topologies.by_name(name, 16)
    assert schedule.n == 16 and schedule.name == name


def test_hierarchical_default_per_node_is_four_when_nodes_is_a_power_of_two():
    assert topologies.by_name("hierarchical", 16).params == {"nodes": 4, "per_node": 4}
    assert topologies.by_name("alternating_exp_ring", 12, per_node=3).params == {"nodes": 4, "per_node": 3}


def test_compare_16_tabulates_every_built_in_and_skips_none(capsys):
    assert main(["compare", "-n", "16"]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out
    for name in topologies.names():
        assert _row(out, name)


def test_compare_16_rho_values_match_the_spec(capsys):
    main(["compare", "-n", "16"])
    out = capsys.readouterr().out
    assert _row(out, "ring")[5] == "0.9493"  # F.3 table
    assert _row(out, "static_exponential")[5] == "0.6000"  # 1 - 2/(1 + log2 16)
    assert _row(out, "one_peer_hypercube")[7:9] == ["0.0000", "4"]  # exact after log2 16 steps
    assert _row(out, "one_peer_exponential")[7:9] == ["0.0000", "4"]
    assert _row(out, "complete")[-2:] == ["1", "0.938"]  # one step; the floor of W = J, (n - 1) / n
    assert _row(out, "one_peer_hypercube")[-1] == _row(out, "base_graph")[-1] == "1.625"


def test_compare_says_which_schedules_are_skipped_and_why(capsys):
    main(["compare", "-n", "12"])
    out = capsys.readouterr().out
    assert "skipped one_peer_hypercube: one_peer_hypercube needs n to be a power of two >= 2, got n=12" in out
    assert _row(out, "ring")


def test_describe_prints_period_degrees_rho_and_steps(capsys):
    assert main(["describe", "one_peer_hypercube", "-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "period              3" in out
    assert "in-degree           1..1" in out
    assert "rho per step        1.0000, 1.0000, 1.0000" in out
    assert "rho per period      0" in out
    assert "steps to consensus  3" in out


def test_describe_ring_prints_optimal_overrelaxation(capsys):
    main(["describe", "ring", "-n", "8"])
    assert "optimal gamma*      1.3084" in capsys.readouterr().out


def test_describe_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "aer.png"
    assert main(["describe", "alternating_exp_ring", "-n", "8", "--per-node", "2", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steps 0..3" in capsys.readouterr().out


def test_describe_of_an_impossible_size_fails_with_the_reason(capsys):
    assert main(["describe", "hypercube", "-n", "12"]) == 2
    assert "error: hypercube needs n to be a power of two, got n=12" in capsys.readouterr().err


def test_module_runs_as_a_program():
    result = subprocess.run(
        [sys.executable, "-m", "topologies", "describe", "complete", "-n", "4"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "steps to consensus  1" in result.stdout
