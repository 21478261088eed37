"""Runtime model (experiments.runtime_model; docs/design.md B.5/E.2): costs, regimes, B.5 table, tables."""

import io
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.runtime_model.cli import predict_table, validation_table
from experiments.runtime_model.costs import (
    Network,
    RuntimeModelError,
    allreduce_time,
    group_allreduce_time,
    hierarchical_allreduce_time,
    hierarchical_gossip_time,
    ring_allreduce_time,
)
from experiments.runtime_model.model import (
    allreduce_iteration,
    expected_max_compute,
    gossip_iteration,
    predict_iteration,
)

REPO = Path(__file__).resolve().parent.parent
MB = 1e6
GBIT = 1e9 / 8  # bytes/s


def test_ring_allreduce_known_values():
    alpha, bandwidth, m = 1e-3, 1e8, 4e6
    assert ring_allreduce_time(m, 2, alpha, bandwidth) == pytest.approx(2 * alpha + m / bandwidth)
    assert ring_allreduce_time(m, 4, alpha, bandwidth) == pytest.approx(6 * alpha + 1.5 * m / bandwidth)
    assert ring_allreduce_time(m, 1, alpha, bandwidth) == 0.0


def test_hierarchical_allreduce_reduces_to_flat_ring_when_local_size_is_one():
    network = Network(2e-3, GBIT, intra_latency_s=1e-5, intra_bandwidth_Bps=10 * GBIT, local_size=1)
    for n in (2, 8, 32):
        flat = ring_allreduce_time(50 * MB, n, 2e-3, GBIT)
        assert hierarchical_allreduce_time(50 * MB, 1, n, network) == pytest.approx(flat)
        assert allreduce_time(50 * MB, n, network, "ring") == pytest.approx(flat)


def test_hierarchical_allreduce_known_value_two_nodes_of_four():
    network = Network(1e-3, GBIT, intra_latency_s=1e-5, intra_bandwidth_Bps=10 * GBIT, local_size=4)
    m = 8 * MB
    expected = 6 * 1e-5 + 1.5 * m / (10 * GBIT) + 2 * 1e-3 + m / GBIT
    assert hierarchical_allreduce_time(m, 4, 2, network) == pytest.approx(expected)


def test_ring_allreduce_is_the_flat_ring_as_gloo_runs_it_even_across_nodes():
    # 2 nodes x 2 ranks, node-major ring: 2 (g - 1) = 6 steps of M / 4 through one uplink each; "best" may pick the
    # hierarchical form (intra ring, then an all-reduce of M between the 2 nodes), which Gloo does not run
    network = Network(1e-4, 12.5 * MB, intra_latency_s=1e-4, intra_bandwidth_Bps=3e9, local_size=2)
    m = 8.388608 * MB
    assert allreduce_time(m, 4, network, "ring") == pytest.approx(6 * (1e-4 + m / 4 / (12.5 * MB)))
    hierarchical = hierarchical_allreduce_time(m, 2, 2, network, "best")
    assert allreduce_time(m, 4, network, "best") == pytest.approx(hierarchical)
    assert hierarchical < allreduce_time(m, 4, network, "ring")


def test_group_of_two_is_a_full_duplex_pairwise_exchange():
    network = Network(1e-3, GBIT, intra_latency_s=1e-5, intra_bandwidth_Bps=10 * GBIT, local_size=2)
    assert group_allreduce_time(4 * MB, [0, 2], network) == pytest.approx(1e-3 + 4 * MB / GBIT)
    assert group_allreduce_time(4 * MB, [0, 1], network) == pytest.approx(1e-5 + 4 * MB / (10 * GBIT))


def test_exact_gossip_on_complete_graph_costs_one_allreduce():
    network = Network(1e-3, GBIT, intra_bandwidth_Bps=8 * GBIT, local_size=4)
    gossip = predict_iteration(0.05, network, 10 * MB, 16, "complete", "exact")
    assert gossip.comm_s == pytest.approx(allreduce_time(10 * MB, 16, network))


def test_degree_d_shares_one_uplink():
    network = Network(1e-3, GBIT)
    prediction = predict_iteration(0.05, network, 4 * MB, 16, 3, "exact")
    assert prediction.comm_s == pytest.approx(1e-3 + 3 * 4 * MB / GBIT)


def test_compute_bound_fast_network_speedup_is_close_to_one():
    network = Network(1e-5, 100 * GBIT)
    options = {"compute_cv": 0.1}
    allreduce = predict_iteration(0.1, network, 4.4 * MB, 64, None, "allreduce", **options)
    gossip = predict_iteration(0.1, network, 4.4 * MB, 64, "one_peer_hypercube", "exact", **options)
    assert 1.0 <= allreduce.total_s / gossip.total_s <= 1.35


def test_communication_bound_gossip_beats_ring_allreduce_by_more_than_two():
    network = Network(1e-3, GBIT)  # 100 MB model, 1 Gbit/s, 60 ms compute, n = 32
    allreduce = predict_iteration(0.06, network, 100 * MB, 32, None, "allreduce", allreduce_algorithm="ring")
    gossip = predict_iteration(0.06, network, 100 * MB, 32, "one_peer_hypercube", "exact")
    assert allreduce.total_s / gossip.total_s > 2.0


def test_bandwidth_bound_exact_gossip_speedup_approaches_the_byte_ratio():
    # ring all-reduce moves 2(n-1)/n M per rank, a one-peer exchange M: speedup -> 2(n-1)/n when bytes dominate
    network = Network(0.0, 0.1 * GBIT)
    allreduce = predict_iteration(1e-3, network, 500 * MB, 32, None, "allreduce")
    gossip = predict_iteration(1e-3, network, 500 * MB, 32, "one_peer_hypercube", "exact")
    assert allreduce.total_s / gossip.total_s == pytest.approx(2 * 31 / 32, rel=0.01)


@pytest.mark.parametrize(
    ("algorithm", "schedule", "local_size"),
    [
        ("allreduce", None, 1),
        ("allreduce", None, 4),
        ("exact", "one_peer_hypercube", 1),
        ("exact", "static_exponential", 1),
        ("exact", "alternating_exp_ring", 4),
        ("powergossip", "ring", 1),
    ],
)
def test_slower_network_never_predicts_faster_iterations(algorithm, schedule, local_size):
    times = []
    for bandwidth in np.geomspace(1e6, 1e11, 12):  # increasing bandwidth
        network = Network(1e-3, bandwidth, intra_bandwidth_Bps=10 * bandwidth, local_size=local_size)
        prediction = predict_iteration(
            0.05, network, 20 * MB, 16, schedule, algorithm, message_bytes=2 * MB, compute_cv=0.1
        )
        times.append(prediction.total_s)
    assert np.all(np.diff(times) <= 1e-12)


@pytest.mark.parametrize(
    ("t_allreduce", "t_gossip", "cv", "expected_allreduce", "expected_gossip"),
    [(0.030, 0.015, 0.1, 0.081, 0.063), (0.030, 0.015, 0.3, 0.108, 0.070), (0.160, 0.080, 0.1, 0.211, 0.082)],
)
def test_b5_example_table_is_reproduced(t_allreduce, t_gossip, cv, expected_allreduce, expected_gossip):
    common = {"compute_cv": cv, "optimizer_s": 0.002}  # n = 32, mu = 60 ms, one-peer exchange
    allreduce = allreduce_iteration(0.060, t_allreduce, 32, **common)
    gossip = gossip_iteration(0.060, t_gossip, 1, 32, **common)
    assert allreduce.total_s == pytest.approx(expected_allreduce, rel=0.10)
    assert gossip.total_s == pytest.approx(expected_gossip, rel=0.10)


def test_prediction_total_is_the_sum_of_its_parts():
    prediction = gossip_iteration(0.06, [0.02, 0.09], [1, 3], 32, compute_cv=0.2, optimizer_s=0.001)
    parts = prediction.compute_s + prediction.straggler_s + prediction.exposed_comm_s + prediction.optimizer_s
    assert prediction.total_s == pytest.approx(parts)
    assert prediction.exposed_comm_s > 0 and prediction.straggler_s > 0


def test_expected_max_of_two_matches_normal_limit():
    # small cv: lognormal -> normal, E[max of 2 standard normals] = 1 / sqrt(pi)
    cv = 1e-3
    assert expected_max_compute(1.0, cv, 2) == pytest.approx(1 + cv / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_compute(1.0, cv, 1) == 1.0


@pytest.mark.parametrize("schedule", ["one_peer_hypercube", "ring"])
def test_monte_carlo_max_plus_agrees_with_quadrature(schedule):
    network = Network(1e-3, GBIT)
    options = {"compute_cv": 0.3}
    quadrature = predict_iteration(0.06, network, 4 * MB, 32, schedule, "exact", **options)
    simulated = predict_iteration(0.06, network, 4 * MB, 32, schedule, "exact", straggler="montecarlo", **options)
    assert simulated.total_s == pytest.approx(quadrature.total_s, rel=0.10)


def test_powergossip_needs_message_bytes_and_a_symmetric_schedule():
    network = Network(1e-3, GBIT)
    with pytest.raises(RuntimeModelError, match="message_bytes"):
        predict_iteration(0.05, network, 4 * MB, 16, "one_peer_hypercube", "powergossip")
    with pytest.raises(RuntimeModelError, match="not symmetric"):
        predict_iteration(0.05, network, 4 * MB, 16, "static_exponential", "powergossip", message_bytes=1e4)
    with pytest.raises(RuntimeModelError, match="groups of > 2"):
        nodes = Network(1e-3, GBIT, local_size=4)
        predict_iteration(0.05, nodes, 4 * MB, 16, "alternating_exp_ring", "powergossip", message_bytes=1e4)


def test_bad_network_is_rejected_with_its_name():
    with pytest.raises(RuntimeModelError, match="bandwidth_Bps"):
        Network(1e-3, -1.0)
    with pytest.raises(RuntimeModelError, match="local_size=4"):
        allreduce_time(MB, 6, Network(1e-3, GBIT, local_size=4))


def test_validation_table_relative_errors():
    base = {"n": 4, "compute_ms": 11.0, "model_bytes": 4.28 * MB, "latency_ms": 1.0, "bandwidth_Bps": GBIT}
    network = Network(1e-3, GBIT)
    predicted_ms = 1e3 * predict_iteration(0.011, network, 4.28 * MB, 4, "one_peer_hypercube", "exact").total_s
    rows = [
        {**base, "algorithm": "exact", "schedule": "one_peer_hypercube", "measured_ms": 2 * predicted_ms},
        {**base, "algorithm": "exact", "schedule": "one_peer_hypercube", "measured_ms": predicted_ms / 1.25},
    ]
    out = validation_table(rows, file=io.StringIO())
    assert [r["predicted_ms"] for r in out] == pytest.approx([predicted_ms, predicted_ms])
    assert [r["relative_error"] for r in out] == pytest.approx([-0.5, 0.25])


def test_validation_table_names_the_row_with_a_missing_key():
    with pytest.raises(RuntimeModelError, match=r"row 0 misses key\(s\) \['measured_ms'\]"):
        validation_table(
            [
                {
                    "n": 4,
                    "algorithm": "allreduce",
                    "compute_ms": 1,
                    "model_bytes": 1,
                    "latency_ms": 1,
                    "bandwidth_Bps": 1,
                }
            ],
            file=None,
        )


def test_predict_table_speedups_are_allreduce_over_gossip_time():
    rows = predict_table(4.4 * MB, 0.1, Network(1e-3, 0.1 * GBIT), ns=(64,), powergossip_bytes=7e3, file=None)
    baseline = next(r for r in rows if r.method == "allreduce").prediction.total_s
    usable = [r for r in rows if r.prediction is not None and r.method != "allreduce"]
    assert {r.method for r in usable} == {"exact", "powergossip"}
    for row in usable:
        assert row.speedup == pytest.approx(baseline / row.prediction.total_s)


def runtime_model_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m experiments.runtime_model ARGS`` (its tables print to the stdout bound at import)."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.runtime_model", *args], capture_output=True, text=True, cwd=REPO
    )


def test_bandwidth_option_reads_tc_units_in_bytes_per_second():
    """--bandwidth 8gbit and --bandwidth 1gbps are the same link (1e9 byte/s = 8 Gbit/s): the same table."""
    common = ["--model-mb", "10", "--compute-ms", "100", "--latency-ms", "1", "--ns", "64"]
    tables = [runtime_model_cli(*common, "--bandwidth", rate).stdout for rate in ("8gbit", "1gbps")]
    assert tables[0] == tables[1]
    assert "8 Gbit/s" in tables[0]


def test_bandwidth_option_refuses_a_rate_without_unit():
    run = runtime_model_cli("--model-mb", "10", "--compute-ms", "100", "--bandwidth", "1000", "--latency-ms", "1")
    assert run.returncode == 2
    assert "rate '1000' needs a number and a tc(8) unit" in run.stderr


# ---------------------------------------------------------------- hierarchical gossip (E.2, issue 8)
TWO_LEVELS = {"intra_latency_s": 1e-5, "intra_bandwidth_Bps": 10 * GBIT}


def test_hierarchical_gossip_with_one_rank_per_node_is_a_pairwise_exchange_of_the_model():
    network = Network(1e-3, GBIT, local_size=1)
    assert hierarchical_gossip_time(8 * MB, 8, network) == pytest.approx((0.0, 1e-3 + 8 * MB / GBIT))
    options = {"compute_cv": 0.2, "optimizer_s": 1e-3}
    hierarchical = predict_iteration(0.05, network, 8 * MB, 8, None, "hierarchical_gossip", **options)
    hypercube = predict_iteration(0.05, network, 8 * MB, 8, "one_peer_hypercube", "exact", **options)
    assert hierarchical.total_s == pytest.approx(hypercube.total_s)


def test_hierarchical_gossip_on_one_node_costs_only_the_intra_node_phases():
    m = 8 * MB
    expected = 2 * (1e-5 + 3 / 4 * m / (10 * GBIT))  # reduce-scatter + all-gather, 3/4 of M each
    for inter_bandwidth in (1e6, GBIT):
        network = Network(1e-3, inter_bandwidth, local_size=4, **TWO_LEVELS)
        prediction = predict_iteration(0.05, network, m, 4, None, "hierarchical_gossip")
        assert prediction.comm_s == pytest.approx(expected)


def test_hierarchical_gossip_known_value_two_nodes_of_four():
    network = Network(1e-3, GBIT, local_size=4, **TWO_LEVELS)
    m = 8 * MB
    blocking, inter = hierarchical_gossip_time(m, 2, network)
    assert blocking == pytest.approx(2 * (1e-5 + 0.75 * m / (10 * GBIT)))
    assert inter == pytest.approx(1e-3 + m / GBIT)  # 4 shards of M/4 share the node's uplink


def test_hierarchical_gossip_hides_only_the_inter_node_exchange():
    network = Network(1e-3, GBIT, local_size=4, **TWO_LEVELS)
    blocking, inter = hierarchical_gossip_time(8 * MB, 4, network)
    long_compute = predict_iteration(1.0, network, 8 * MB, 16, None, "hierarchical_gossip")
    short_compute = predict_iteration(1e-6, network, 8 * MB, 16, None, "hierarchical_gossip")
    assert long_compute.exposed_comm_s == pytest.approx(blocking)
    assert short_compute.exposed_comm_s == pytest.approx(blocking + inter - 1e-6)


def test_hierarchical_gossip_compressed_sends_the_message_bytes_across_nodes():
    network = Network(1e-3, GBIT, local_size=2, **TWO_LEVELS)
    exact = predict_iteration(1e-3, network, 8 * MB, 8, None, "hierarchical_gossip")
    compressed = predict_iteration(1e-3, network, 8 * MB, 8, None, "hierarchical_gossip", message_bytes=65536)
    assert exact.comm_s - compressed.comm_s == pytest.approx((8 * MB - 65536) / GBIT)


def test_hierarchical_gossip_waits_for_its_node_and_the_partner_node():
    network = Network(1e-3, 100 * GBIT, local_size=4, **TWO_LEVELS)
    prediction = predict_iteration(0.05, network, MB, 16, None, "hierarchical_gossip", compute_cv=0.3)
    assert prediction.straggler_s == pytest.approx(expected_max_compute(0.05, 0.3, 8) - 0.05)


@pytest.mark.parametrize("compute_s", [0.06, 0.01])  # inter-node exchange hidden / exposed
def test_hierarchical_gossip_monte_carlo_equals_quadrature_without_variance(compute_s):
    network = Network(1e-3, GBIT, local_size=4, **TWO_LEVELS)
    options = {"optimizer_s": 1e-3}
    quadrature = predict_iteration(compute_s, network, 4 * MB, 32, None, "hierarchical_gossip", **options)
    simulated = predict_iteration(
        compute_s, network, 4 * MB, 32, None, "hierarchical_gossip", straggler="montecarlo", **options
    )
    assert simulated.total_s == pytest.approx(quadrature.total_s)


def test_hierarchical_gossip_monte_carlo_lies_between_node_max_and_two_node_max():
    # within a node no slack (blocking phases): at least E[max_L C]; across nodes slack: at most E[max_2L C]
    network = Network(1e-3, GBIT, local_size=4, **TWO_LEVELS)
    blocking, _ = hierarchical_gossip_time(4 * MB, 8, network)
    simulated = predict_iteration(
        0.06, network, 4 * MB, 32, None, "hierarchical_gossip", straggler="montecarlo", compute_cv=0.3, steps=2000
    )
    lower = expected_max_compute(0.06, 0.3, 4) + blocking
    upper = expected_max_compute(0.06, 0.3, 8) + blocking
    assert lower * 0.98 <= simulated.total_s <= upper * 1.02


def test_hierarchical_gossip_needs_a_power_of_two_number_of_nodes():
    with pytest.raises(RuntimeModelError, match="hierarchical_gossip with n=12, local_size=4"):
        predict_iteration(0.05, Network(1e-3, GBIT, local_size=4), MB, 12, None, "hierarchical_gossip")


def test_predict_table_lists_hierarchical_gossip_only_with_several_ranks_per_node():
    nodes = Network(1e-3, GBIT, local_size=8, **TWO_LEVELS)
    rows = predict_table(4.4 * MB, 0.1, nodes, ns=(64,), powergossip_bytes=7e3, file=None)
    usable = {(r.method, r.schedule) for r in rows if r.prediction is not None}
    assert {("exact", "hierarchical_gossip"), ("powergossip", "hierarchical_gossip")} <= usable
    flat = predict_table(4.4 * MB, 0.1, Network(1e-3, GBIT), ns=(64,), powergossip_bytes=7e3, file=None)
    assert all(r.prediction is None for r in flat if r.schedule == "hierarchical_gossip")
