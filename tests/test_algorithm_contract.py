"""The base Algorithm's contract: config() and describe() for every algorithm, composites built from their parts."""

from __future__ import annotations

import pytest
import torch

import gossip
import topologies
from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.hierarchical import HierarchicalGossip, inter_node_pairs
from gossip.algorithms.periodic import PeriodicAverage
from gossip.buckets import pack
from gossip.replicas import algorithm_config
from topologies.schedule import ScheduleError

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


# -- composites bind their parts to a level of their own schedule, and never rewrite them afterwards --------------
def bound_schedules(comm) -> dict:
    seen = []
    algorithm = HierarchicalGossip(compress_rank=1, local_size=2, min_compression=1)
    compressor = algorithm._compressor
    original_setup = compressor.setup

    def recording_setup(comm, schedule, buckets):
        seen.append(schedule)
        original_setup(comm, schedule, buckets)

    compressor.setup = recording_setup
    algorithm.setup(comm, None, buckets_of(comm.rank))
    return {
        "bound_to": [schedule.name for schedule in seen],
        "kept": algorithm.inner is compressor and algorithm.inner.schedule is seen[0],
    }


def test_hierarchical_gossip_binds_its_compressor_to_the_inter_node_pairs_without_swapping_them_in_later():
    for result in gossip.simulate(4, bound_schedules, local_size=2):
        assert result == {"bound_to": ["hierarchical-inter"], "kept": True}


def bind_disconnected(comm, as_part: bool) -> str:
    composite, part = ExactGossip(), ExactGossip()
    composite.setup(comm, topologies.ring(comm.size), buckets_of(comm.rank))
    pairs = inter_node_pairs(2, 2)  # disconnected: ranks 0-2 and 1-3 only
    if as_part:
        composite.setup_part(part, pairs, buckets_of(comm.rank))
        return f"bound to {part.schedule.name}, part_of reset: {part._part_of is None}"
    part.setup(comm, pairs, buckets_of(comm.rank))
    return "bound"


def test_a_level_schedule_is_accepted_only_as_a_part_of_a_validated_composite():
    for message in gossip.simulate(4, bind_disconnected, True):
        assert message == "bound to hierarchical-inter, part_of reset: True"
    with pytest.raises(ScheduleError, match="connected"):
        gossip.simulate(4, bind_disconnected, False)
