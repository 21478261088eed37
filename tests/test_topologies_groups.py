"""``Schedule.groups(t)``: the exact-averaging partition of a step, or None, as its docstring defines it.

The definition is checked literally (below) against the implementation on steps that are partitions, almost
partitions (overlapping groups of the right sizes, a wrong weight) and neither; and ``groups`` must not be
quadratic in the group size: the complete graph of 1024 ranks is one group.
"""

import numpy as np
import pytest

import topologies
from topologies import Schedule


def literal_groups(schedule: Schedule, t: int) -> list[tuple[int, ...]] | None:
    """Every rank i gives 1/|g| to each member of g = {i} U in_peers(i), and all members of g have group g."""
    group_of = []
    for i in range(schedule.n):
        view = schedule.peers(i, t)
        members = tuple(sorted([i, *(j for j, _ in view.in_peers)]))
        weights = [view.self_weight, *(w for _, w in view.in_peers)]
        if any(abs(w - 1 / len(members)) > 1e-12 for w in weights):
            return None
        group_of.append(members)
    if any(group_of[j] != g for g in group_of for j in g):
        return None
    return sorted(set(group_of))


def _step(n: int, entries: list[tuple[int, int, float]]) -> Schedule:
    rows, cols, weights = (np.array(a) for a in zip(*entries, strict=True))
    return Schedule(n, "step", lambda phase: (rows, cols, weights), 1, validate=False)


def _partition_entries(groups: list[list[int]]) -> list[tuple[int, int, float]]:
    return [(i, j, 1 / len(g)) for g in groups for i in g for j in g]


def test_overlapping_groups_of_the_right_sizes_are_not_a_partition():
    # g(0) = {0, 1}, g(1) = {0, 1}, g(2) = {0, 2}, g(3) = {0, 3}: every weight is 1/2, but 0 sits in three groups.
    entries = [(0, 0, 0.5), (0, 1, 0.5), (1, 1, 0.5), (1, 0, 0.5), (2, 2, 0.5), (2, 0, 0.5), (3, 3, 0.5), (3, 0, 0.5)]
    assert _step(4, entries).groups(0) is None


@pytest.mark.parametrize("seed", range(60))
def test_groups_agree_with_the_literal_definition(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    labels = rng.integers(0, max(1, n // 2), size=n)
    groups = [np.flatnonzero(labels == label).tolist() for label in np.unique(labels)]
    entries = _partition_entries(groups)
    change = rng.integers(0, 4)
    if change == 1 and len(entries) > 1:  # drop one entry
        entries.pop(int(rng.integers(len(entries))))
    elif change == 2:  # perturb one weight
        k = int(rng.integers(len(entries)))
        entries[k] = (*entries[k][:2], entries[k][2] + 1e-9)
    elif change == 3:  # add one edge across groups
        i, j = (int(v) for v in rng.integers(0, n, size=2))
        entries.append((i, j, 0.25))
    schedule = _step(n, entries)
    assert schedule.groups(0) == literal_groups(schedule, 0)


@pytest.mark.parametrize(("nodes", "per_node"), [(1, 4), (2, 3), (8, 2)])
def test_hierarchical_groups_agree_with_the_literal_definition(nodes, per_node):
    schedule = topologies.hierarchical(nodes, per_node)
    for t in schedule.check_steps:
        assert schedule.groups(t) == literal_groups(schedule, t) is not None


def test_complete_graph_of_1024_is_one_group():
    assert topologies.complete(1024).groups(0) == [tuple(range(1024))]
