"""The base Algorithm's contract: config() and describe() for every algorithm, composites built from their parts."""

from __future__ import annotations

import pytest
import torch

import gossip
import topologies
from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.periodic import PeriodicAverage
from gossip.buckets import pack
from gossip.replicas import algorithm_config

SHAPES = {"fc.weight": (6, 4), "fc.bias": (6,), "out.weight": (2, 6)}

ALGORITHMS = {
    "exact": lambda: ExactGossip(gamma=0.5),
    "allreduce": AllReduce,
    "periodic-exact": lambda: PeriodicAverage(ExactGossip(), every=2),
}


def buckets_of(rank: int):
    generator = torch.Generator().manual_seed(rank)
    return pack([(name, torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()])


def configs_around_training(comm, factory) -> dict:
    algorithm = factory()
    before = algorithm_config(algorithm)
    algorithm.setup(comm, topologies.ring(comm.size), buckets_of(comm.rank))
    for step in range(3):
        algorithm.step(step)
    state = algorithm.state_dict()
    fresh = factory()
    fresh.setup(comm, topologies.ring(comm.size), buckets_of(comm.rank))
    fresh.load_state_dict(state)  # refused when the saved config differs from the fresh one
    return {"before": before, "after": algorithm_config(algorithm), "described": algorithm.describe()}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_config_is_the_settings_only_the_same_before_and_after_training_and_a_state_reloads(name):
    for result in gossip.simulate(4, configs_around_training, ALGORITHMS[name]):
        assert result["before"] == result["after"]
        assert "wait_seconds" not in str(result["after"]) and "traffic" not in str(result["after"])


def test_the_default_config_and_description_of_the_simple_algorithms():
    results = gossip.simulate(4, configs_around_training, ALGORITHMS["exact"])
    assert results[0]["after"] == {"name": "exact", "gamma": 0.5}
    assert results[0]["described"] == {"exact": list(SHAPES)}
    periodic = gossip.simulate(4, configs_around_training, ALGORITHMS["periodic-exact"])[0]
    assert periodic["after"] == {"name": "periodic-average", "every": 2, "inner": {"name": "exact", "gamma": 1.0}}
    assert periodic["described"] == {"every": 2, "inner": {"exact": list(SHAPES)}}
