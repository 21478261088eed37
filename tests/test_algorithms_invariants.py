"""Invariants of the gossip algorithms on the in-process simulator (docs/design.md A.12)."""

from __future__ import annotations

import pytest
import torch
from helpers.algorithm_scenarios import SHAPES, local_model, make_algorithm, run_steps

import gossip
import topologies
from gossip.algorithms import PowerGossipTuning
from gossip.algorithms.buckets import pack
from gossip.app.gpt import GPT, GPTConfig

SYMMETRIC = ["hypercube", "ring"]
ALGORITHMS = [
    "exact",
    "exact-overrelaxed",
    "powergossip-r1",
    "powergossip-r2-2it",
    "powergossip-r2-2it-every",
    "powergossip-r2-2it-fp16",
]


@pytest.mark.parametrize(("n", "schedule"), [(n, s) for n in (2, 4, 8, 16) for s in SYMMETRIC if (s, n) != ("ring", 2)])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sum_over_ranks_is_preserved_after_every_step(n, schedule, algorithm):
    results = gossip.simulate(n, run_steps, algorithm, schedule, steps=6)
    sums = results[0]["sums"]
    for step, total in enumerate(sums[1:], start=1):
        relative = (total - sums[0]).norm() / sums[0].norm()
        assert relative < 1e-6, f"step {step}: sum drifted by {relative:.2e}"


@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize(
    "algorithm", ["powergossip-r1", "powergossip-r2-2it", "powergossip-r2-2it-every", "powergossip-r2-2it-fp16"]
)
def test_both_ends_of_every_edge_hold_bit_identical_factors(n, algorithm):
    results = gossip.simulate(n, run_steps, algorithm, "hypercube", steps=6)
    for step in range(6):
        for rank, result in enumerate(results):
            for (lo, hi), (iteration, p, q) in result["factors"][step].items():
                other = results[hi if rank == lo else lo]["factors"][step][(lo, hi)]
                assert iteration == other[0], f"step {step} edge {(lo, hi)}: parity counters differ"
                assert all(torch.equal(a, b) for a, b in zip(p + q, other[1] + other[2], strict=True)), (
                    f"step {step} edge {(lo, hi)}: factors differ"
                )


def test_idle_edges_keep_their_factors_and_parity():
    """On the 8-node one-peer hypercube each edge is used every third step; its counter counts its own uses."""
    results = gossip.simulate(8, run_steps, "powergossip-r1", "hypercube", steps=7)
    after_first_use = results[0]["factors"][0][(0, 1)]
    idle = results[0]["factors"][2][(0, 1)]  # steps 1 and 2 use the other two edges of rank 0
    assert after_first_use[0] == idle[0] == 1
    assert all(
        torch.equal(a, b) for a, b in zip(after_first_use[1] + after_first_use[2], idle[1] + idle[2], strict=True)
    )
    assert results[0]["factors"][6][(0, 1)][0] == 3


def _one_step(comm, algorithm, square: int):
    generator = torch.Generator().manual_seed(comm.rank)
    buckets = pack([("w", torch.randn(square, square, generator=generator, dtype=torch.float64))])
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    for step in range(3):
        algorithm.step(step)
    return buckets[0].buffer


def test_full_rank_powergossip_on_square_matrices_equals_exact_gossip():
    always = lambda name, shape: True  # noqa: E731 -- compress even though the ratio is below 1
    exact = gossip.simulate(4, lambda c: _one_step(c, gossip.ExactGossip(), 6))
    full = gossip.simulate(4, lambda c: _one_step(c, gossip.PowerGossip(rank=6, policy=always), 6))
    for e, f in zip(exact, full, strict=True):
        # equal up to the 1e-8 guard in the normalisation (measured: 1.3e-7 relative after three steps)
        assert (f - e).norm() / e.norm() < 1e-6


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3)
        self.conv2 = torch.nn.Conv2d(16, 32, 3)
        self.bn = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)


@pytest.mark.parametrize("model", ["cnn", "transformer"])
@pytest.mark.parametrize(("rank", "iterations"), [(1, 1), (2, 1), (2, 2), (1, 3)])
def test_bytes_per_step_match_the_formula_of_section_a9(model, rank, iterations):
    """Products every power iteration, the uncompressed tensors once per step."""
    module = SmallCNN() if model == "cnn" else GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    shapes = [tuple(p.shape) for p in module.parameters()]
    schedule = topologies.one_peer_hypercube(4)

    def run(comm):
        buckets = pack([(name, p.detach()) for name, p in module.named_parameters()])
        algo = gossip.PowerGossip(rank=rank, num_iterations=iterations, min_compression=1)
        algo.setup(comm, schedule, buckets)
        steps = 4 * schedule.period  # every edge used in both parities
        for step in range(steps):
            algo.step(step)
        return algo.traffic.total_sent / steps, algo.describe()

    per_step, described = gossip.simulate(4, run)[0]
    assert len(described["compressed"]) == sum(len(s) >= 2 for s in shapes)
    assert per_step == pytest.approx(
        topologies.bytes_per_step(schedule, shapes, "powergossip", rank=rank, rank_id=0, iterations=iterations)
    )
    uncompressed = topologies.bytes_per_step(schedule, shapes, "exact", rank_id=0)
    print(f"{model} rank {rank}: PowerGossip {per_step:.0f} B/step vs exact gossip {uncompressed:.0f} B/step")


@pytest.mark.parametrize("attempt", range(20))  # the two ranks' threads race to bind it: every attempt is refused
def test_one_algorithm_object_shared_by_two_ranks_is_refused(attempt):
    shared = gossip.ExactGossip()

    def run(comm):
        shared.setup(comm, topologies.one_peer_hypercube(2), local_model(comm.rank))

    with pytest.raises(ValueError, match="create one algorithm object per rank"):
        gossip.simulate(2, run)


def test_a_refused_setup_leaves_the_object_free_for_another_rank():
    algorithm = gossip.ExactGossip()

    def refused_on_rank_0(comm):
        if comm.rank == 0:  # a schedule of 4 ranks in a world of 2
            algorithm.setup(comm, topologies.one_peer_hypercube(4), local_model(comm.rank))

    with pytest.raises(ValueError, match="4"):
        gossip.simulate(2, refused_on_rank_0)
    assert getattr(algorithm, "comm", None) is None

    def bound_on_rank_1(comm):
        if comm.rank == 1:
            algorithm.setup(comm, topologies.one_peer_hypercube(2), local_model(comm.rank))

    gossip.simulate(2, bound_on_rank_1)
    assert algorithm.comm.rank == 1


def test_asymmetric_schedule_is_refused_by_powergossip():
    def run(comm):
        gossip.PowerGossip().setup(comm, topologies.one_peer_exponential(4), local_model(comm.rank))

    with pytest.raises(topologies.ScheduleError, match="symmetric"):
        gossip.simulate(4, run)


@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_powergossip_rank_below_one_or_not_integer_is_refused(rank):
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        gossip.PowerGossip(rank=rank)


def test_policy_forcing_a_rank_larger_than_the_matrix_is_refused():
    def run(comm):
        algo = gossip.PowerGossip(rank=6, policy=lambda name, shape: True)
        algo.setup(comm, topologies.one_peer_hypercube(2), pack([("head.weight", torch.zeros(5, 20))]))

    with pytest.raises(ValueError, match=r"rank 6 is larger than parameter 'head.weight' of shape \(5, 20\)"):
        gossip.simulate(2, run)


def test_policy_keeps_named_parameters_uncompressed():
    def run(comm):
        algo = gossip.PowerGossip(rank=1, min_compression=1, policy=gossip.exclude_names(r"^fc\."))
        algo.setup(comm, topologies.one_peer_hypercube(2), local_model(comm.rank))
        return algo.describe()

    described = gossip.simulate(2, run)[0]
    assert described["exact"] == ["fc.weight", "fc.bias"]
    assert described["compressed"] == [n for n in SHAPES if n not in ("fc.weight", "fc.bias")]


def test_powergossip_state_dict_resumes_bit_identically():
    def run(comm):
        straight_buckets, resumed_buckets = local_model(comm.rank), local_model(comm.rank)
        schedule = topologies.one_peer_hypercube(comm.size)
        straight = gossip.PowerGossip(rank=2, min_compression=1)
        straight.setup(comm, schedule, straight_buckets)
        for step in range(6):
            straight.step(step)
        first = gossip.PowerGossip(rank=2, min_compression=1)
        first.setup(comm, schedule, resumed_buckets)
        for step in range(3):
            first.step(step)
        second = gossip.PowerGossip(rank=2, min_compression=1)
        second.setup(comm, schedule, resumed_buckets)
        second.load_state_dict(first.state_dict())
        for step in range(3, 6):
            second.step(step)
        return all(torch.equal(a.buffer, b.buffer) for a, b in zip(straight_buckets, resumed_buckets, strict=True))

    assert all(gossip.simulate(4, run))


def _identical_then_perturbed(comm, schedule: str, rank: int, steps: int) -> tuple[float, float, list]:
    """Step 0 on identical replicas (as after the initial broadcast or a global average), then perturb and mix."""
    buckets = pack([("w", torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))])
    algorithm = gossip.PowerGossip(rank=rank, min_compression=1)
    algorithm.setup(
        comm, {"hypercube": topologies.one_peer_hypercube, "ring": topologies.ring}[schedule](comm.size), buckets
    )
    algorithm.step(0)
    buckets[0].buffer.add_(torch.randn(256, generator=torch.Generator().manual_seed(100 + comm.rank)))

    def disagreement() -> float:
        total = buckets[0].buffer.clone()
        comm.all_reduce(total)
        return float(((buckets[0].buffer - total / comm.size) ** 2).sum())

    before = disagreement()
    for step in range(1, steps + 1):
        algorithm.step(step)
    factors = [f for edge in algorithm.edges.values() for f in edge.p + edge.q]
    return before, disagreement(), factors


@pytest.mark.parametrize("schedule", SYMMETRIC)
@pytest.mark.parametrize("rank", [1, 2])
def test_an_edge_first_used_on_identical_replicas_keeps_mixing(schedule, rank):
    """R = a_hi - a_lo is zero on identical replicas; taken as the next factor it would silence the edge forever."""
    results = gossip.simulate(4, _identical_then_perturbed, schedule, rank, 40)
    before, after = sum(r[0] for r in results), sum(r[1] for r in results)
    assert after < 0.2 * before, f"disagreement {before:.1f} -> {after:.1f}: some edge stopped mixing"
    for rank_index, (_, _, factors) in enumerate(results):
        dead = [i for i, f in enumerate(factors) if (f.abs().amax(dim=0) == 0).any()]
        assert not dead, f"rank {rank_index}: factors {dead} hold an all-zero column"


def test_the_warm_start_rule_replaces_only_all_zero_columns():
    from gossip.algorithms.powergossip_factors import keep_nonzero_columns_

    # A class's block of factors stored transposed: a row per factor column. Row 0 is zero throughout, row 2 too
    # (its last element is padding); row 1 has a zero element only, row 3 no positive one: both are taken.
    incoming = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, -2.0], [0.0, 0.0, 0.0], [-3.0, -1.0, 0.0]])
    factor = torch.arange(12.0).view(4, 3) + 10
    keep_nonzero_columns_(incoming, factor)
    expected = torch.tensor([[10.0, 11.0, 12.0], [1.0, 0.0, -2.0], [16.0, 17.0, 18.0], [-3.0, -1.0, 0.0]])
    assert torch.equal(factor, expected)


@pytest.mark.parametrize(
    ("rows", "kept", "maybe"),
    [
        ([[1, 2, 3], [-3, 1, 0], [5, 0], [6, 0]], [], False),  # no column sums to 0: R replaces the factors whole
        ([[1, 2, 3], [-3, -1, 0], [5, 0], [6, 0]], [], False),  # largest element 0, not a zero column: taken too
        ([[1, 2, 3], [-3, 1, 2], [5, 0], [6, 0]], [], True),  # sums to 0 but is not zero: decided per column, taken
        ([[1, 2, 3], [-3, -1, 0], [0, 0], [6, 0]], [2], True),  # a zero column keeps the factor's
    ],
)
def test_r_replaces_the_factors_but_for_its_columns_zero_throughout(rows, kept, maybe):
    """Two classes of factors stored transposed (a row per factor column), of 3 and 2 rows, the second padded
    (each row's last element): the columns' sums, read on the host with the received uncompressed tensors' sum,
    tell whether the rule runs at all; where it runs, it keeps only the columns zero throughout."""
    from gossip.algorithms.powergossip_factors import column_sums, replace_factors
    from gossip.algorithms.powergossip_layout import Replacement

    incoming = torch.tensor([float(v) for row in rows for v in row])
    flat = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 0.0, 18.0, 0.0])
    expected = incoming.clone()
    for row in kept:
        expected[6 + 2 * (row - 2) : 8 + 2 * (row - 2)] = flat[6 + 2 * (row - 2) : 8 + 2 * (row - 2)]
    sums = torch.empty(4 + 1)
    views = [(incoming[:6].view(2, 3), flat[:6].view(2, 3)), (incoming[6:].view(2, 2), flat[6:].view(2, 2))]
    blocks = [(a, b, part) for (a, b), part in zip(views, sums[:4].split([2, 2]), strict=True)]
    replaced = Replacement(
        flat=flat, incoming=incoming, stored=[], sources=[], blocks=blocks, sums=sums, exact_sum=sums[-1], columns=4
    )
    values = column_sums(replaced, torch.tensor([4.0, -7.0, 2.5]))
    assert values == [*(float(sum(row)) for row in rows), -0.5]
    assert (0.0 in values[:4]) == maybe
    replace_factors(replaced, maybe)
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("algorithm", ["powergossip-r1", "powergossip-r2-2it"])
def test_identical_replicas_stay_identical_under_powergossip(algorithm):
    """Consensus is a fixed point of gossip: with R = a_hi - a_lo = 0 the correction must be 0, whatever factor
    is kept as the next warm start (as after the initial broadcast, or right after a global average)."""

    def run(comm) -> list[bool]:
        buckets = local_model(0)  # the same tensors on every rank
        start = [b.buffer.clone() for b in buckets]
        mixer = make_algorithm(algorithm)
        mixer.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
        unchanged = []
        for step in range(4):
            mixer.step(step)
            unchanged.append(all(torch.equal(b.buffer, s) for b, s in zip(buckets, start, strict=True)))
        return unchanged

    for rank, unchanged in enumerate(gossip.simulate(4, run)):
        assert all(unchanged), (
            f"rank {rank}: identical replicas moved at steps {[i for i, u in enumerate(unchanged) if not u]}"
        )


def uncompressed_mixing(schedule: str) -> dict[bool, list[dict]]:
    """Four ranks, two power iterations per step, the uncompressed tensors mixed once per step or every iteration."""
    runs = {}
    for every in (False, True):

        def run(comm, every=every):
            buckets = local_model(comm.rank)
            tuning = PowerGossipTuning(uncompressed_every_iteration=every)
            algo = gossip.PowerGossip(rank=2, num_iterations=2, min_compression=1, tuning=tuning)
            algo.setup(
                comm, {"hypercube": topologies.one_peer_hypercube, "ring": topologies.ring}[schedule](4), buckets
            )
            for step in range(6):
                algo.step(step)
            bias = next(b.view(e) for b in buckets for e in b.entries if e.name == "fc.bias").clone()
            return {"buffers": [b.buffer.clone() for b in buckets], "sent": algo.traffic.total_sent, "bias": bias}

        runs[every] = gossip.simulate(4, run)
    return runs


def test_one_peer_and_gamma_1_the_uncompressed_tensors_mixed_once_per_step_give_the_same_models_for_fewer_bytes():
    """On the one-peer hypercube with gamma = 1 both ends hold the pair's average after the first iteration, so a
    second exact mixing changes nothing: the same bits, and the uncompressed tensors' bytes saved once per step."""
    runs = uncompressed_mixing("hypercube")
    uncompressed_bytes = 4 * sum(torch.Size(shape).numel() for shape in SHAPES.values() if len(shape) < 2)
    for once, every in zip(runs[False], runs[True], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(once["buffers"], every["buffers"], strict=True))
        assert every["sent"] - once["sent"] == 6 * uncompressed_bytes  # one peer, 6 steps, one message saved each


def test_with_several_peers_mixing_the_uncompressed_tensors_every_iteration_averages_them_further():
    """On the ring (two peers, weights 1/3) a second exact mixing is a second averaging round: the uncompressed
    tensors end closer to their mean over ranks (the mean itself is preserved either way)."""
    runs = uncompressed_mixing("ring")
    spread = {}
    for every, results in runs.items():
        biases = torch.stack([result["bias"] for result in results])
        spread[every] = (biases - biases.mean(0)).norm()
    torch.testing.assert_close(
        torch.stack([r["bias"] for r in runs[False]]).mean(0), torch.stack([r["bias"] for r in runs[True]]).mean(0)
    )
    assert spread[True] < 0.5 * spread[False], spread
