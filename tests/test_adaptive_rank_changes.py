"""Adaptive PowerGossip on the simulator: rank changes stay synchronous, exact in sum, and decided globally (C.4)."""

from __future__ import annotations

import pytest
import torch

import gossip
import topologies
from gossip.algorithms.adaptive_rank import AdaptivePowerGossip
from gossip.algorithms.buckets import pack

SHAPES = {"a.weight": (16, 24), "a.bias": (16,), "b.weight": (20, 12)}
RANKS = [(1, 3), (2, 3), (4, 3), (8, 3), (2, 3), (1, 3)]  # (rank, steps at it): up and down the ladder


def model(rank: int, shapes: dict = SHAPES) -> list:
    generator = torch.Generator().manual_seed(rank)
    return pack(
        [(name, torch.randn(shape, generator=generator, dtype=torch.float64)) for name, shape in shapes.items()]
    )


def ticking_clock(seconds: float = 0.1):
    now = [0.0]

    def clock() -> float:
        now[0] += seconds
        return now[0]

    return clock


def change_ranks(comm: gossip.Communicator) -> dict:
    buckets = model(comm.rank)
    algorithm = AdaptivePowerGossip(ladder=(1, 2, 4, 8), every=10**6, min_compression=1)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    sums, factors, step = [], [], 0
    for rank, steps in RANKS:
        algorithm.set_rank(rank)
        for _ in range(steps):
            algorithm.step(step)
            step += 1
        total = torch.cat([b.buffer for b in buckets])
        comm.all_reduce(total)
        sums.append(total)
        factors.append({key: [t.clone() for t in e.p + e.q] for key, e in algorithm.edges.items()})
    return {"sums": sums, "factors": factors, "initial": torch.cat([b.buffer for b in model(comm.rank)])}


@pytest.fixture(scope="module", params=[2, 4, 8])
def changed(request) -> tuple[int, list[dict]]:
    return request.param, gossip.simulate(request.param, change_ranks)


def test_both_ends_of_every_edge_hold_identical_factors_after_each_rank_change(changed):
    n, results = changed
    for phase, (rank, _) in enumerate(RANKS):
        for me in range(n):
            for (lo, hi), tensors in results[me]["factors"][phase].items():
                theirs = results[hi if me == lo else lo]["factors"][phase][(lo, hi)]
                assert all(torch.equal(a, b) for a, b in zip(tensors, theirs, strict=True)), (n, phase, lo, hi)
                assert all(t.shape[1] == rank for t in tensors)


def test_parameter_sum_is_preserved_across_rank_changes(changed):
    _, results = changed
    initial = sum(r["initial"] for r in results)
    for phase in range(len(RANKS)):
        torch.testing.assert_close(results[0]["sums"][phase], initial, rtol=0, atol=1e-10)


def grow_and_shrink(comm: gossip.Communicator) -> list:
    algorithm = AdaptivePowerGossip(ladder=(1, 2, 4), every=10**6, min_compression=1)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), model(comm.rank))
    algorithm.step(0)
    edge = next(iter(algorithm.edges.values()))
    before = [t.clone() for t in edge.p + edge.q]
    algorithm.set_rank(4)
    grown = [t.clone() for t in edge.p + edge.q]
    algorithm.set_rank(2)
    return [before, grown, [t.clone() for t in edge.p + edge.q]]


def test_increase_appends_columns_and_decrease_drops_trailing_ones():
    before, grown, shrunk = gossip.simulate(2, grow_and_shrink)[0]
    assert all(torch.equal(g[:, :1], b) for g, b in zip(grown, before, strict=True))
    assert all(torch.equal(s, g[:, :2]) for s, g in zip(shrunk, grown, strict=True))


def too_large(comm: gossip.Communicator) -> None:
    algorithm = AdaptivePowerGossip(ladder=(1, 2), min_compression=1)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), model(comm.rank))
    algorithm.set_rank(13)


def test_rank_beyond_a_matrix_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'b.weight' of shape \(20, 12\) allows at most rank 12"):
        gossip.simulate(2, too_large)


def adapt(
    comm: gossip.Communicator, steps: int = 40, reopen_at: int | None = None, shapes: dict = SHAPES, **options
) -> list[dict]:
    algorithm = AdaptivePowerGossip(clock=ticking_clock(), min_compression=1, **options)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), model(comm.rank, shapes))
    for step in range(steps):
        if step == reopen_at and comm.rank == 1:
            algorithm.reopen()
        algorithm.step(step)
    return algorithm.history


def test_every_rank_takes_the_same_decisions_at_the_same_steps():
    histories = gossip.simulate(4, adapt, ladder=(1, 2, 4, 8), every=8)
    assert all(h == histories[0] for h in histories)
    assert [h["step"] for h in histories[0]] == [8, 16, 24, 32, 40]
    assert [h["rank"] for h in histories[0]][:2] == [1, 2]  # the search climbs the ladder first


def test_reopen_on_one_rank_restarts_the_search_everywhere():
    histories = gossip.simulate(4, adapt, ladder=(1, 2, 4), every=5, steps=30, reopen_at=21)
    reopened = [h for h in histories[0] if h["reopened"]]
    assert [h["step"] for h in reopened] == [25] and reopened[0]["next_rank"] == 1
    assert all(h == histories[0] for h in histories)


def test_full_rank_with_every_coordinate_sampled_captures_the_whole_difference():
    square, policy = {"w.weight": (8, 8)}, lambda name, shape: True  # compressed although rank 8 saves nothing
    history = gossip.simulate(2, adapt, ladder=(8,), every=4, steps=8, sketch_size=64, shapes=square, policy=policy)[0]
    assert history[0]["pair_distance"] > 0  # the difference was measured, not defaulted
    assert history[0]["gain"] == pytest.approx(1.0, rel=1e-6)  # Gram-Schmidt divides by norm + 1e-8
