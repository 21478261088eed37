"""The base Algorithm's contract: config() and describe() for every algorithm, composites built from their parts,
and one account of each step's bytes and waits, kept by the base class from what the communicator was given."""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import gossip
import topologies
from gossip.algorithms.adaptive_rank import AdaptivePowerGossip
from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.base import COLLECTIVE
from gossip.algorithms.buckets import pack
from gossip.algorithms.choco_sign import ChocoSign
from gossip.algorithms.diloco import DiLoCo
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.hierarchical import HierarchicalGossip, inter_node_pairs
from gossip.algorithms.outer import OuterOptimizer
from gossip.algorithms.periodic import PeriodicAverage
from gossip.algorithms.powergossip import PowerGossip
from gossip.wrapper.replicas import algorithm_config
from topologies.schedule import ScheduleError

SHAPES = {"fc.weight": (6, 4), "fc.bias": (6,), "out.weight": (2, 6)}

ALGORITHMS = {
    "exact": lambda: ExactGossip(gamma=0.5),
    "allreduce": AllReduce,
    "periodic-exact": lambda: PeriodicAverage(ExactGossip(), every=2),
    "diloco": lambda: DiLoCo(local_steps=2),
    "choco-sign": lambda: ChocoSign(chunk=8),
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


# -- one account per step: the base class books what the communicator was given ---------------------------------
ALGORITHM_SOURCES = Path(gossip.__file__).parent / "algorithms"
#: The one communication outside a step's account: PeriodicAverage's blocking fallback when the mean is not finite.
NOT_A_STEP = {("periodic.py", "_replace_nonfinite_mean")}


def unbooked_calls(source: str, filename: str) -> list[str]:
    """Calls in ``source`` that count bytes by hand or communicate past the account: ``<...>traffic.record(...)``,
    ``<...>comm.exchange(...)``, ``<...>comm.start_planned(...)``, ``<...>comm.all_reduce(...)``, outside the
    functions of :data:`NOT_A_STEP`."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef) or (filename, function.name) in NOT_A_STEP:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner, attr = ast.unparse(node.func.value), node.func.attr
                if (attr == "record" and owner.endswith("traffic")) or (
                    attr in ("exchange", "start_planned", "all_reduce") and owner.endswith("comm")
                ):
                    found.append(f"{filename}:{node.lineno} {function.name}: {ast.unparse(node.func)}")
    return sorted(set(found))


def test_no_algorithm_counts_its_own_bytes():
    """Byte accounting lives in the communicator (``exchange``/``all_reduce`` given a ``traffic``), reached through
    the base class's ``_exchange``/``_start_planned``/``_all_reduce``: no algorithm module records bytes or calls
    the communicator past the account."""
    offenders = [
        call
        for path in sorted(ALGORITHM_SOURCES.glob("*.py"))
        if path.name != "base.py"
        for call in unbooked_calls(path.read_text(), path.name)
    ]
    assert offenders == []


def test_the_accounting_check_finds_a_hand_written_record_and_a_direct_exchange():
    source = (
        "def start(self, step):\n"
        "    self.traffic.record(1, 8, 8)\n"
        "    self.comm.start_planned(plan, seq=step)\n"
        "    return self.comm.exchange([], [], seq=step)\n"
        "def _replace_nonfinite_mean(self):\n"
        "    self.comm.all_reduce(x)\n"
    )
    assert unbooked_calls(source, "new.py") == [
        "new.py:2 start: self.traffic.record",
        "new.py:3 start: self.comm.start_planned",
        "new.py:4 start: self.comm.exchange",
        "new.py:6 _replace_nonfinite_mean: self.comm.all_reduce",
    ]
    assert unbooked_calls(source, "periodic.py") == [
        "periodic.py:2 start: self.traffic.record",
        "periodic.py:3 start: self.comm.start_planned",
        "periodic.py:4 start: self.comm.exchange",
    ]


COMPOSITES = {
    "periodic-powergossip": lambda: PeriodicAverage(PowerGossip(rank=1, min_compression=1), every=2),
    "periodic-exact": lambda: PeriodicAverage(ExactGossip(), every=3),
    "hierarchical-compressed": lambda: HierarchicalGossip(compress_rank=1, local_size=2, min_compression=1),
    "adaptive": lambda: AdaptivePowerGossip(ladder=(1, 2), every=2, min_compression=1),
}


def composite_accounts(comm, factory) -> dict:
    algorithm = factory()
    schedule = None if isinstance(algorithm, HierarchicalGossip) else topologies.one_peer_hypercube(comm.size)
    algorithm.setup(comm, schedule, buckets_of(comm.rank))
    parts = [part for part in (getattr(algorithm, "inner", None),) if part is not None]
    before = dict(comm.bytes_sent)
    steps = []
    for step in range(4):
        algorithm.step(step)
        steps.append(dict(algorithm.traffic.last_sent))
    point_to_point = {p: b - before.get(p, 0) for p, b in comm.bytes_sent.items() if b != before.get(p, 0)}
    return {
        "shared": all(part.traffic is algorithm.traffic for part in parts),
        "steps": steps,
        "sent": dict(algorithm.traffic.sent),
        "comm_sent": point_to_point,
        "part_wait": [part.wait_seconds for part in parts],
        "bucket_bytes": sum(bucket.nbytes for bucket in buckets_of(comm.rank)),
    }


@pytest.mark.parametrize("name", COMPOSITES)
def test_a_composite_books_what_its_parts_moved_once(name):
    """The parts share the composite's account: per step, the bytes are what the communicator was handed (the
    all-reduce of an averaging step under COLLECTIVE, as a ring moves it), none counted twice; the waits are the
    composite's."""
    for rank, result in enumerate(gossip.simulate(4, composite_accounts, COMPOSITES[name], local_size=2)):
        assert result["shared"], f"rank {rank}: a part keeps its own account"
        assert result["part_wait"] == [0.0] * len(result["part_wait"]), f"rank {rank}: a part's waits went astray"
        sent = dict(result["sent"])
        collective = sent.pop(COLLECTIVE, 0)
        assert sent == result["comm_sent"], f"rank {rank}"
        totals: dict[int, int] = {}
        for step in result["steps"]:
            for peer, nbytes in step.items():
                totals[peer] = totals.get(peer, 0) + nbytes
        assert totals == result["sent"], f"rank {rank}: the steps' bytes do not add up to the total"
        if name.startswith("periodic"):
            averages = sum((s + 1) % COMPOSITES[name]().every == 0 for s in range(4))
            assert collective == averages * round(2 * 3 / 4 * result["bucket_bytes"])
        else:
            assert collective == 0


def compressed_after_setup(comm, factory) -> tuple[int, list[str]]:
    algorithm = factory()
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), buckets_of(comm.rank))
    return algorithm.matrix_rank, [matrix.entry.name for matrix in algorithm.matrices]


def test_adaptive_powergossip_chooses_its_matrices_for_the_top_rung_and_starts_at_the_bottom_one():
    """The compressed matrices must fit every rung of the ladder, so they are chosen for the top one
    (``largest_matrix_rank``: at rank 2, out.weight (2 x 6) compresses 12 / 16 < 1), while the rank in use is
    the bottom rung; a plain rank-1 PowerGossip compresses both matrices."""
    adaptive = lambda: AdaptivePowerGossip(ladder=(1, 2), every=2, min_compression=1)  # noqa: E731
    plain = lambda: PowerGossip(rank=1, min_compression=1)  # noqa: E731
    assert gossip.simulate(2, compressed_after_setup, adaptive)[0] == (1, ["fc.weight"])
    assert gossip.simulate(2, compressed_after_setup, plain)[0] == (1, ["fc.weight", "out.weight"])


# -- start and finish are the base class's: the step's bookkeeping cannot be skipped ---------------------------
@pytest.mark.parametrize(("method", "hook"), [("start", "_start_step"), ("finish", "_finish_step")])
def test_a_subclass_overriding_start_or_finish_is_refused_when_the_class_is_created(method, hook):
    body = {method: lambda self, arg: None, "_start_step": lambda self, step: None, "_finish_step": lambda *_: None}
    with pytest.raises(TypeError, match=rf"Sneaky overrides Algorithm\.{method}\(\).*implement {hook}\(\) instead"):
        type("Sneaky", (ExactGossip,), body)


class Silent(gossip.Algorithm):
    """Implements only its own part of a step: no exchange, and no call to any bookkeeping."""

    name = "silent"

    def _start_step(self, step: int) -> int:
        return step

    def _finish_step(self, pending: int) -> None:
        return None


def bookkeeping_of_a_minimal_algorithm(comm) -> dict:
    algorithm = Silent()
    algorithm.setup(comm, topologies.ring(comm.size), buckets_of(comm.rank))
    algorithm.traffic.record(0, 8, 8)  # what a previous step would have left in the account
    algorithm.wait_seconds = 1.0
    flags = torch.tensor([False])
    algorithm._unchecked.append((6, [comm.size - 1 - comm.rank], flags, None))  # a deferred finding of step 6
    try:
        algorithm.start(7)
    except gossip.NonFiniteError as error:
        raised = str(error)
    pending = algorithm.start(8)
    algorithm.finish(pending)
    return {
        "raised": raised,
        "pending": pending,
        "last": dict(algorithm.traffic.last_sent),
        "wait": algorithm.wait_seconds,
    }


def test_start_does_the_bookkeeping_for_an_algorithm_that_implements_only_its_own_part():
    for rank, result in enumerate(gossip.simulate(2, bookkeeping_of_a_minimal_algorithm)):
        assert f"rank {rank}: step 6: peer {1 - rank} sent non-finite values" in result["raised"]
        assert result["pending"] == 8
        assert result["last"] == {} and result["wait"] == 0.0


STATEFUL = {
    **ALGORITHMS,
    **COMPOSITES,
    "powergossip": lambda: PowerGossip(rank=1, num_iterations=2, min_compression=1),
    "hybrid": lambda: OuterOptimizer(
        AllReduce(), local_steps=3, outer_lr=1.0, outer_momentum=0.0, between=PowerGossip(rank=1, min_compression=1)
    ),
}
#: The ones whose state changes as they train (the others keep none, or none that moves in six steps).
CHANGING = {
    "diloco",
    "choco-sign",
    "periodic-powergossip",
    "hierarchical-compressed",
    "adaptive",
    "powergossip",
    "hybrid",
}


def identical(a: Any, b: Any) -> bool:
    """The same nested containers, keys, scalars and tensors (dtype and every element)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def state_through_more_steps(comm, factory) -> dict:
    algorithm = factory()
    schedule = None if isinstance(algorithm, HierarchicalGossip) else topologies.one_peer_hypercube(comm.size)
    algorithm.setup(comm, schedule, buckets_of(comm.rank))
    for step in range(3):
        algorithm.step(step)
    returned, snapshot = algorithm.state_dict(), algorithm.state_snapshot()
    kept = copy.deepcopy(returned)
    for step in range(3, 9):
        algorithm.step(step)
    return {
        "claims": algorithm.state_dict_is_snapshot,
        "returned_unchanged": identical(returned, kept),
        "snapshot_unchanged": identical(snapshot, kept),
        "state_moved": not identical(algorithm.state_dict(), kept),
    }


@pytest.mark.parametrize("name", STATEFUL)
def test_every_algorithm_s_state_dict_is_a_snapshot_that_later_steps_leave_alone(name):
    """The wrapper keeps ``state_snapshot()`` from before each start without copying it again, because every
    built-in algorithm says its ``state_dict`` is already a copy; the claim is checked here: what was returned after
    three steps is still the same, element for element, after six more, while the algorithm's own state moved."""
    for rank, result in enumerate(gossip.simulate(4, state_through_more_steps, STATEFUL[name], local_size=2)):
        assert result["claims"], f"rank {rank}: {name} does not say its state_dict is a snapshot"
        assert result["returned_unchanged"] and result["snapshot_unchanged"], f"rank {rank}: later steps changed it"
        assert result["state_moved"] == (name in CHANGING), f"rank {rank}: {result}"


class LiveState(ExactGossip):
    """A user's algorithm whose state_dict hands out its live counter (not a copy)."""

    def __init__(self):
        super().__init__()
        self.seen = torch.zeros(1)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}


class CopiedState(LiveState):
    state_dict_is_snapshot = True

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen.clone()}


class InheritsCopiedState(CopiedState):
    pass


def test_an_algorithm_that_does_not_say_its_state_dict_is_a_snapshot_is_deep_copied():
    """ExactGossip says its (empty) state is a snapshot; a subclass that writes its own state_dict does not inherit
    that answer unless it repeats it, so a live tensor it returns is copied before later steps change it."""
    live = LiveState()
    kept = live.state_snapshot()
    live.seen += 1
    assert (ExactGossip.state_dict_is_snapshot, LiveState.state_dict_is_snapshot) == (True, False)
    assert kept["seen"].item() == 0.0 and live.state_dict()["seen"].item() == 1.0
    assert CopiedState.state_dict_is_snapshot and InheritsCopiedState.state_dict_is_snapshot
    assert PeriodicAverage(LiveState(), every=2).state_dict_is_snapshot is False
    assert PeriodicAverage(CopiedState(), every=2).state_dict_is_snapshot is True
