"""Consensus distance (exact and sampled, docs/design.md F.4) and the averaged() evaluation context (simulator)."""

from __future__ import annotations

import statistics

import torch
from helpers.parallel_scenarios import averaged_and_consensus, batch, flat_parameters, loss_of, make_mlp, wrap

import gossip
from gossip.wrapper.consensus import ConsensusSampler, allocate_samples, exact_consensus_sq

N = 4
# A few hundred k parameters in layers of very different sizes.
SHAPES = [(256, 512), (512,), (512, 256), (256,), (256, 64), (64,), (10, 64), (10,)]


def replicas(rank: int) -> list[torch.Tensor]:
    """Shared base plus rank-specific deviations whose scale differs per layer (1e-3 .. 1)."""
    shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(100 + rank)
    scales = torch.logspace(-3, 0, len(SHAPES))
    return [
        torch.randn(s, generator=shared) + scale * torch.randn(s, generator=own)
        for s, scale in zip(SHAPES, scales, strict=True)
    ]


def reference_sq() -> float:
    """Xi^2 in float64 from all replicas at once."""
    stacked = [torch.stack([replicas(r)[k].double() for r in range(N)]) for k in range(len(SHAPES))]
    return sum(float((x - x.mean(0)).square().sum()) for x in stacked) / N


def estimates(comm, samples: int, steps: range) -> dict:
    tensors = replicas(comm.rank)
    sampler = ConsensusSampler([t.numel() for t in tensors], samples, seed=7)
    return {
        "exact": exact_consensus_sq(tensors, comm),
        "sampled": [sampler.estimate_sq(tensors, comm, step) for step in steps],
    }


def test_exact_consensus_distance_equals_the_float64_definition():
    expected = reference_sq()
    for result in gossip.simulate(N, estimates, 16, range(0)):
        assert abs(result["exact"] - expected) <= 1e-9 * expected


def test_sampled_estimate_has_median_relative_error_below_5_percent_at_16k_coordinates():
    results = gossip.simulate(N, estimates, 16384, range(9))
    exact = results[0]["exact"]
    errors = [abs(estimate - exact) / exact for estimate in results[0]["sampled"]]
    assert statistics.median(errors) < 0.05, errors


def test_every_rank_gets_the_same_estimate():
    results = gossip.simulate(N, estimates, 4096, range(3))
    assert all(result["sampled"] == results[0]["sampled"] for result in results)


def test_sampling_every_coordinate_gives_the_exact_value():
    total = sum(torch.Size(s).numel() for s in SHAPES)
    result = gossip.simulate(N, estimates, total, range(1))[0]
    assert abs(result["sampled"][0] - result["exact"]) <= 1e-9 * result["exact"]


def test_samples_are_allocated_proportionally_with_a_floor_per_tensor():
    assert allocate_samples([1000, 10, 90_000], 1000) == [83, 10, 989]  # floor 1000 // 12 = 83
    assert allocate_samples([1000, 10, 90_000], 10) == [1, 1, 10]  # floor 1
    assert allocate_samples([5, 7], 100) == [5, 7]  # everything


def test_averaged_restores_the_replicas_bit_identically_and_holds_the_mean():
    results = gossip.simulate(N, averaged_and_consensus)
    mean = torch.stack([r["before"] for r in results]).double().mean(0)
    for result in results:
        assert torch.equal(result["after"], result["before"])
        torch.testing.assert_close(result["inside"].double(), mean, rtol=1e-6, atol=1e-6)


def test_consensus_distance_method_is_the_root_of_the_mean_squared_distance_to_the_mean():
    results = gossip.simulate(N, averaged_and_consensus)
    stacked = torch.stack([r["before"] for r in results]).double()
    expected = float((stacked - stacked.mean(0)).square().sum(1).mean().sqrt())
    assert abs(results[0]["consensus"] - expected) <= 1e-9 * expected


def evaluate_mid_step(comm) -> dict:
    """averaged() between optimizer.step() and the next forward must not change the training trajectory."""
    out = {}
    for evaluate in (False, True):
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            if evaluate and step == 2:
                with model.averaged():
                    pass
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        out[evaluate] = flat_parameters(model)
        model.close()
    return out


def test_evaluating_the_average_does_not_change_the_training_trajectory():
    for result in gossip.simulate(N, evaluate_mid_step):
        assert torch.equal(result[True], result[False])
