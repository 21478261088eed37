"""Spectral and consensus values pinned to docs/design.md F.2, F.3, B.2, E.2 and A.9."""

import math

import numpy as np
import pytest

import topologies
from topologies import analysis


@pytest.mark.parametrize("n", [8, 16, 32, 64])
def test_static_exponential_rho_is_one_minus_two_over_one_plus_log2_n(n):
    expected = 1 - 2 / (1 + math.log2(n))
    assert topologies.rho(topologies.static_exponential(n).mixing_matrix(0)) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("build", [topologies.one_peer_hypercube, topologies.one_peer_exponential])
def test_product_of_log2_n_one_peer_matrices_equals_j_exactly(build, n):
    schedule = build(n)
    assert schedule.period == int(math.log2(n))
    np.testing.assert_allclose(topologies.period_product(schedule), np.full((n, n), 1 / n), rtol=0, atol=1e-15)


@pytest.mark.parametrize("build", [topologies.one_peer_hypercube, topologies.one_peer_exponential])
def test_product_over_any_log2_n_consecutive_steps_equals_j(build):
    schedule, n = build(16), 16
    product = np.eye(n)
    for t in range(5, 5 + 4):
        product = schedule.mixing_matrix(t) @ product
    np.testing.assert_allclose(product, np.full((n, n), 1 / n), rtol=0, atol=1e-15)


def test_single_one_peer_hypercube_step_has_rho_one():
    assert topologies.step_rhos(topologies.one_peer_hypercube(16)) == pytest.approx([1.0] * 4)


def test_single_one_peer_exponential_step_has_rho_one_except_shift_one_with_cos_pi_over_n():
    # W = (I + S^s)/2 has eigenvalues (1 + w^s)/2 over the n-th roots w: rho = 1 when gcd(s, n) > 1,
    # and cos(pi/n) for the shift s = 1 of step 0 (F.2's "rho = 1" was measured at t = 1).
    expected = [math.cos(math.pi / 16), 1.0, 1.0, 1.0]
    assert topologies.step_rhos(topologies.one_peer_exponential(16)) == pytest.approx(expected, abs=1e-12)


def test_uniform_ring_of_eight_has_rho_0_8047():
    assert topologies.rho(topologies.ring(8).mixing_matrix(0)) == pytest.approx(0.8047, abs=5e-5)


def test_uniform_ring_of_eight_has_optimal_overrelaxation_1_3084():
    assert topologies.optimal_overrelaxation(topologies.ring(8)) == pytest.approx(1.3084, abs=5e-5)


@pytest.mark.parametrize(("n", "expected"), [(16, 0.9493), (32, 0.9872), (64, 0.9968)])
def test_uniform_ring_rho_matches_the_f3_table(n, expected):
    assert topologies.rho(topologies.ring(n).mixing_matrix(0)) == pytest.approx(expected, abs=5e-5)


def test_spectral_gap_is_one_minus_rho():
    w = topologies.ring(8).mixing_matrix(0)
    assert topologies.spectral_gap(w) == pytest.approx(1 - 0.8047, abs=5e-5)


def test_overrelaxation_at_gamma_star_contracts_faster_than_plain_gossip():
    w = topologies.ring(8).mixing_matrix(0)
    gamma = topologies.optimal_overrelaxation(w)
    relaxed = np.eye(8) + gamma * (w - np.eye(8))
    assert topologies.rho(relaxed) < topologies.rho(w)


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (4, 2), (8, 4), (16, 3)])
def test_alternating_exp_ring_has_period_two_log2_nodes(nodes, per_node):
    assert topologies.alternating_exp_ring(nodes, per_node).period == 2 * int(math.log2(nodes))


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (4, 2), (8, 4), (16, 3)])
def test_alternating_exp_ring_puts_every_rank_in_exactly_one_group_per_step(nodes, per_node):
    schedule = topologies.alternating_exp_ring(nodes, per_node)
    for t in schedule.check_steps:
        members = [r for group in schedule.groups(t) for r in group]
        assert sorted(members) == list(range(nodes * per_node))
        assert {len(g) for g in schedule.groups(t)} <= {per_node, 2 * per_node}


@pytest.mark.parametrize("nodes", [4, 8, 16])
def test_alternating_exp_ring_has_half_the_nodes_inter_node_each_step(nodes):
    per_node = 2
    schedule = topologies.alternating_exp_ring(nodes, per_node)
    for t in schedule.check_steps:
        inter_ranks = sum(len(g) for g in schedule.groups(t) if len(g) == 2 * per_node)
        assert inter_ranks == nodes * per_node // 2


def test_alternating_exp_ring_pairs_nodes_across_hypercube_dimensions():
    schedule = topologies.alternating_exp_ring(4, 2)
    inter = [[g for g in schedule.groups(t) if len(g) == 4] for t in range(4)]
    assert inter == [[(4, 5, 6, 7)], [(0, 1, 2, 3)], [(2, 3, 6, 7)], [(0, 1, 4, 5)]]


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (8, 4), (16, 2)])
def test_alternating_exp_ring_is_exact_after_one_period(nodes, per_node):
    assert topologies.period_rho(topologies.alternating_exp_ring(nodes, per_node)) < 1e-14


@pytest.mark.parametrize(("nodes", "per_node"), [(1, 4), (2, 2), (4, 3), (8, 1)])
def test_hierarchical_has_period_log2_nodes_and_groups_of_two_nodes(nodes, per_node):
    schedule = topologies.hierarchical(nodes, per_node)
    assert schedule.period == max(1, int(math.log2(nodes)))
    for t in schedule.check_steps:
        groups = schedule.groups(t)
        assert sorted(r for g in groups for r in g) == list(range(nodes * per_node))
        assert {len(g) for g in groups} == {per_node * min(nodes, 2)}


def test_hierarchical_is_node_partner_exchange_kron_intra_node_average():
    nodes, per_node = 4, 3
    schedule = topologies.hierarchical(nodes, per_node)
    intra = np.full((per_node, per_node), 1 / per_node)
    for t in range(2):
        w_node = 0.5 * (np.eye(nodes) + np.eye(nodes)[np.arange(nodes) ^ (1 << t)])
        np.testing.assert_allclose(schedule.mixing_matrix(t), np.kron(w_node, intra), atol=1e-15)


def test_one_peer_schedules_reach_consensus_in_log2_n_steps():
    assert topologies.steps_to_consensus(topologies.one_peer_hypercube(16)) == 4
    assert topologies.steps_to_consensus(topologies.complete(16)) == 1


def test_steps_to_consensus_matches_the_per_step_rate_of_a_symmetric_static_graph():
    # For symmetric static W the worst-case ratio after t steps is rho^(2t).
    rate = topologies.rho(topologies.ring(16).mixing_matrix(0))
    expected = math.ceil(math.log(1e-6) / (2 * math.log(rate)))
    assert topologies.steps_to_consensus(topologies.ring(16), tol=1e-6) == expected


def test_simulated_consensus_distance_reaches_zero_after_one_hypercube_period():
    trajectory = topologies.simulate_consensus(topologies.one_peer_hypercube(8), 6, dim=5, seed=1)
    assert trajectory.shape == (7,)
    assert trajectory[0] > 1 and trajectory[3] < 1e-25


def test_simulated_consensus_distance_never_increases_under_doubly_stochastic_mixing():
    trajectory = topologies.simulate_consensus(topologies.random_regular(16, 3), 40, seed=2)
    assert np.all(np.diff(trajectory) <= 1e-12)


def test_expected_consensus_rate_of_one_peer_hypercube_is_one_over_log2_n_steps():
    assert topologies.expected_consensus_rate(topologies.one_peer_hypercube(32)) == topologies.ConsensusRate(
        p=pytest.approx(1.0), tau=5
    )


def test_expected_consensus_rate_of_static_graph_is_one_minus_rho_squared():
    rate = topologies.expected_consensus_rate(topologies.ring(8))
    assert rate.tau == 1 and rate.p == pytest.approx(1 - 0.8047378541**2, abs=1e-9)


RESNET20_MATRICES = (
    [(16, 27)] + [(16, 144)] * 6 + [(32, 144), (32, 288), (32, 16)] + [(32, 288)] * 4
    + [(64, 288), (64, 576), (64, 32)] + [(64, 576)] * 4 + [(10, 64)]
)  # fmt: skip
RESNET20_ONE_D = [(10,)] + [(16,)] * 2 + [(16,)] * 12 + [(32,)] * 14 + [(64,)] * 14  # bias, BN weight/bias


def test_resnet20_rank1_powergossip_sends_4852_floats_per_neighbour():
    shapes = RESNET20_MATRICES + RESNET20_ONE_D
    floats = topologies.bytes_per_step(topologies.ring(8), shapes, "powergossip", rank=1) / 4 / 2
    assert round(floats) == 4852


def test_resnet20_full_gossip_sends_the_whole_model_per_neighbour():
    shapes = RESNET20_MATRICES + RESNET20_ONE_D
    assert topologies.bytes_per_step(topologies.ring(8), shapes, "exact") == 2 * 272_474 * 4


def test_powergossip_reshapes_conv_kernels_to_first_dim_by_rest():
    # (8, 3, 3, 3) -> (8, 27); r = 2: odd 2*8, even 2*27, averaged; one peer per step on the hypercube
    sent = topologies.bytes_per_step(topologies.one_peer_hypercube(8), [(8, 3, 3, 3)], "powergossip", rank=2)
    assert sent == (2 * 8 + 2 * 27) / 2 * 4


def test_powergossip_rank_is_capped_by_the_matrix_dimensions():
    sent = topologies.bytes_per_step(topologies.one_peer_hypercube(8), [(3, 5)], "powergossip", rank=10)
    assert sent == (3 * 3 + 3 * 5) / 2 * 4


def test_allreduce_sends_two_n_minus_one_over_n_of_the_model():
    sent = topologies.bytes_per_step(topologies.ring(8), [(100, 10)], "allreduce", bytes_per_element=2)
    assert sent == pytest.approx(2 * 7 / 8 * 1000 * 2)


def test_bytes_per_step_for_one_rank_counts_its_own_out_peers():
    star = topologies.star(5)
    assert topologies.bytes_per_step(star, [(10,)], rank_id=0) == 4 * 10 * 4
    assert topologies.bytes_per_step(star, [(10,)], rank_id=3) == 1 * 10 * 4


def test_step_rhos_cover_one_period():
    assert len(analysis.step_rhos(topologies.alternating_exp_ring(8, 2))) == 6


def test_torus_of_four_is_the_four_ring_and_of_eight_has_degree_three():
    import numpy as np

    from topologies import by_name, ring

    four = by_name("torus", 4)  # the 4-cycle 0-1-3-2 (row-major numbering): a relabelled ring(4)
    assert all(len(four.peers(rank, 0).in_peers) == 2 for rank in range(4))
    spectrum = np.linalg.eigvalsh
    assert np.allclose(spectrum(four.mixing_matrix(0)), spectrum(ring(4).mixing_matrix(0)))
    eight = by_name("torus", 8)
    assert eight.params["rows"] == 2 and eight.is_doubly_stochastic and eight.is_symmetric
    assert all(len(eight.peers(rank, 0).in_peers) == 3 for rank in range(8))


def test_torus_of_a_prime_number_of_ranks_is_refused():
    from topologies import ScheduleError, by_name

    with pytest.raises(ScheduleError, match="n=7 has no such split"):
        by_name("torus", 7)


@pytest.mark.parametrize("n", [2, 5, 12])
def test_the_noise_floor_of_exact_averaging_at_every_step_is_one_minus_one_over_n(n):
    """W = J: the disagreement is the last step's centred noise, whose variance per coordinate is (n - 1) / n."""
    assert analysis.noise_floor(topologies.complete(n)) == pytest.approx((n - 1) / n, rel=1e-12)


@pytest.mark.parametrize(
    "build", [lambda: topologies.ring(8), lambda: topologies.torus(3, 4), lambda: topologies.ring(5)]
)
def test_the_noise_floor_of_a_static_symmetric_w_is_its_eigenvalues_sum(build):
    """One W every step: S = W S W + (I - J) is diagonal in W's eigenvectors, so the floor is
    (1/n) sum over the eigenvalues lambda != 1 of 1 / (1 - lambda^2)."""
    schedule = build()
    eigenvalues = np.sort(np.linalg.eigvalsh(schedule.mixing_matrix(0)))[:-1]  # the 1 of the mean left out
    expected = float(np.sum(1.0 / (1.0 - eigenvalues**2))) / schedule.n
    assert analysis.noise_floor(schedule) == pytest.approx(expected, rel=1e-9)


def test_the_noise_floor_of_a_time_varying_schedule_is_the_simulated_steady_state():
    """The Base-2 graph over 6 ranks (period 4, a rank idle in some steps): x <- W(t) x + xi simulated for 20,000
    steps on 64 coordinates, its mean Xi^2 per coordinate after a burn-in, within 3 % of the computed floor."""
    schedule = topologies.base_graph(6)
    generator = np.random.default_rng(0)
    values, seen = np.zeros((6, 64)), []
    for t in range(20_000):
        values = analysis.apply_step(schedule, t, values) + generator.standard_normal((6, 64))
        if t >= 100:
            seen.append(float(np.mean(np.sum((values - values.mean(axis=0)) ** 2, axis=0))) / 6)
    assert np.mean(seen) == pytest.approx(analysis.noise_floor(schedule), rel=0.03)


def _unvalidated(matrix: np.ndarray, name: str) -> topologies.Schedule:
    """A static schedule of ``matrix`` built without validation (which refuses both below)."""
    rows, cols = np.nonzero(matrix)
    return topologies.Schedule(len(matrix), name, lambda t: (rows, cols, matrix[rows, cols]), 1, validate=False)


def test_the_noise_floor_is_infinite_without_mixing_and_undefined_when_the_mean_drifts():
    assert analysis.noise_floor(_unvalidated(np.eye(4), "identity")) == math.inf
    drifting = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])  # rows sum to 1, columns do not
    assert math.isnan(analysis.noise_floor(_unvalidated(drifting, "drifting")))


def test_the_noise_floor_ranks_the_one_peer_schedules_at_24_ranks():
    """Where n is not a power of two the Base-2 graph leaves ranks idle and sustains a wider spread than random
    matchings; at a power of two it is the hypercube, below random matchings."""
    floors = {name: analysis.noise_floor(topologies.by_name(name, 24)) for name in ("base_graph", "random_matchings")}
    assert floors["random_matchings"] < floors["base_graph"]
    at_16 = {name: analysis.noise_floor(topologies.by_name(name, 16)) for name in ("base_graph", "random_matchings")}
    assert at_16["base_graph"] == analysis.noise_floor(topologies.one_peer_hypercube(16)) < at_16["random_matchings"]
