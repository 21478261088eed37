"""Membership changes on the simulator (gossip.wrapper.elastic_sim): departures and joins at step boundaries.

Properties pinned, deterministically:

* exact gossip: after a departure at t the survivors' mean equals the mean of their replicas just before t, at every
  later step; after a join it moves by the joiner's copy only, to (m x̄ + x_donor) / (m + 1);
* the joiner holds its donor's parameters and optimizer state at the join (Adam, and AccumAdamW with its accumulators);
* the schedule is rebuilt in the same family, or falls back (and says so) when the family needs n = 2^k;
* PowerGossip: per-edge state only for edges of the new group, both ends bit-identical, the sum preserved across
  churn, and the joiner/donor edge (identical replicas at the join) is not silenced: the replicas keep converging;
* PeriodicAverage: its next averaging step after a departure makes every survivor equal to the survivors' mean;
* a plan that removes a non-member, or leaves nobody, is refused with a named error;
* no collective runs inside a step after a change (the schedule-agreement check of a schedule without period is off:
  a change could interrupt it after the update was applied).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import optim
import topologies
from gossip import DecentralizedDataParallel, ExactGossip, PeriodicAverage, PowerGossip
from gossip.errors import InvalidArgumentError
from gossip.wrapper.elastic import schedule_for
from gossip.wrapper.elastic_sim import Change, Member, plan_epochs, simulate_elastic

SIZE, STEPS = 8, 24


def _build(with_optimizer: bool = False, make_optimizer=lambda params: torch.optim.Adam(params, lr=1e-3)):
    def build(comm, schedule, algorithm, uid):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4)).double()
        model = DecentralizedDataParallel(net, comm, schedule, algorithm, consensus_every=0)
        with torch.no_grad():  # distinct replicas: uid-dependent offsets
            for bucket in model.buckets:
                bucket.buffer.add_(torch.linspace(-1, 1, bucket.buffer.numel(), dtype=torch.float64) * (uid + 1))
        optimizer = make_optimizer(model.parameters()) if with_optimizer else None
        return Member(uid, model, optimizer)

    return build


def mix_only(member: Member, step: int) -> None:
    """One step of pure mixing (no update): what the algorithms do to the replicas, nothing else."""
    member.model.finish_mixing()
    member.model.next_step()


def flat(member: Member) -> torch.Tensor:
    return torch.cat([b.buffer for b in member.model.buckets]).clone()


def mean(members, uids) -> torch.Tensor:
    return torch.stack([flat(members[u]) for u in uids]).mean(0)


def test_exact_gossip_mean_after_departure_and_join():
    snapshots = {}

    def between(start, members):
        snapshots[start] = {uid: flat(m) for uid, m in members.items()}

    changes = [Change(8, 3), Change(16, 3, join=True)]
    members, epochs = simulate_elastic(
        SIZE, STEPS, changes, build=_build(), train_step=mix_only, schedule="one_peer_hypercube",
        algorithm=ExactGossip, between=between,
    )  # fmt: skip
    assert [e.members for e in epochs] == [tuple(range(8)), (0, 1, 2, 4, 5, 6, 7), tuple(range(8))]
    survivors = [0, 1, 2, 4, 5, 6, 7]
    before_drop = torch.stack([snapshots[8][u] for u in survivors]).mean(0)
    before_join = torch.stack([snapshots[16][u] for u in survivors]).mean(0)
    torch.testing.assert_close(before_join, before_drop, rtol=0, atol=1e-12)  # 7 ranks mixed, mean unchanged
    donor = epochs[2].joined[3]
    assert donor in survivors
    expected = (7 * before_join + snapshots[16][donor]) / 8
    torch.testing.assert_close(mean(members, range(8)), expected, rtol=0, atol=1e-12)
    # the 7-rank epoch could not be a hypercube: it fell back and said why
    assert epochs[1].schedule.startswith("base_graph (fallback: one_peer_hypercube")
    assert epochs[2].schedule == "one_peer_hypercube"


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda params: torch.optim.Adam(params, lr=1e-3), lambda params: optim.AccumAdamW(params, lr=1e-3, accum_iter=4)],
    ids=["adam", "accum_adamw"],
)
def test_joiner_receives_donor_parameters_and_optimizer_state(make_optimizer):
    seen = {}

    def train(member: Member, step: int) -> None:
        model = member.model
        if step == 6 and member.uid == 9:  # the joiner's first step: before its first forward
            seen["joiner"] = (flat(member), copy.deepcopy(member.optimizer.state_dict()))
        x = torch.full((2, 6), float(member.uid + step), dtype=torch.float64)
        model(x).square().mean().backward()
        member.optimizer.step()
        member.optimizer.zero_grad()

    def between(start, members):
        if start == 6:
            seen["before"] = {uid: (flat(m), copy.deepcopy(m.optimizer.state_dict())) for uid, m in members.items()}

    members, epochs = simulate_elastic(
        4, 10, [Change(6, 9, join=True)], build=_build(True, make_optimizer), train_step=train,
        schedule="ring", algorithm=ExactGossip, between=between,
    )  # fmt: skip
    donor = epochs[1].joined[9]
    params, state = seen["joiner"]
    torch.testing.assert_close(params, seen["before"][donor][0], rtol=0, atol=0)
    want = seen["before"][donor][1]["state"]
    assert state["state"].keys() == want.keys() and want  # every parameter's state (AccumAdamW: its accumulators too)
    for key in want:
        assert state["state"][key].keys() == want[key].keys()
        for name, value in want[key].items():
            torch.testing.assert_close(
                torch.as_tensor(state["state"][key][name]), torch.as_tensor(value), rtol=0, atol=0
            )
    assert members[9].model.step_count == 10  # it continued at the group's step


def test_schedule_fallback_and_family_kept():
    """A one-peer family that cannot be built falls back to the one-peer Base-2 graph, the default schedule's
    choice there, exact after one period; a family that can is kept."""
    assert schedule_for("one_peer_hypercube", 4)[1] == "one_peer_hypercube"
    for n in (1, 3, 5, 6, 7):
        schedule, note = schedule_for("one_peer_hypercube", n)
        assert note.startswith("base_graph (fallback: one_peer_hypercube") and schedule.n == n
        assert schedule.period == topologies.by_name("base_graph", n).period  # the exact average's steps
    assert schedule_for("one_peer_ring", 5)[1].startswith("base_graph (fallback")
    assert schedule_for("random_matchings", 5)[1] == "random_matchings"
    assert schedule_for("torus", 5)[1].startswith("ring (fallback")
    assert schedule_for("ring", 5)[1] == "ring"


def test_powergossip_state_consistent_under_churn():
    snapshots = {}

    def between(start, members):
        snapshots[start] = {uid: flat(m) for uid, m in members.items()}

    changes = [Change(8, 5), Change(8, 6), Change(14, 20, join=True)]
    members, epochs = simulate_elastic(
        SIZE, 40, changes, build=_build(), train_step=mix_only, schedule="ring",
        algorithm=lambda: PowerGossip(rank=1), between=between,
    )  # fmt: skip
    last = epochs[-1].members
    assert last == (0, 1, 2, 3, 4, 7, 20)
    survivors = [0, 1, 2, 3, 4, 7]
    # the sum over members is preserved from the drop to the join (corrections equal and opposite)
    torch.testing.assert_close(
        torch.stack([snapshots[14][u] for u in survivors]).sum(0),
        torch.stack([snapshots[8][u] for u in survivors]).sum(0),
        rtol=0, atol=1e-10,
    )  # fmt: skip
    n = len(last)
    for rank, uid in enumerate(last):
        algorithm = members[uid].model.algorithm
        assert algorithm.comm.size == n
        for lo, hi in algorithm.edges:
            assert 0 <= lo < hi < n and rank in (lo, hi)  # only edges of the new group
            other = members[last[hi if rank == lo else lo]].model.algorithm.edges[(lo, hi)]
            mine = algorithm.edges[(lo, hi)]
            for a, b in zip(mine.p + mine.q, other.p + other.q, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)  # both ends identical
    # the joiner/donor edge started from identical replicas; the group still converges
    spread = torch.stack([flat(members[u]) for u in last]).std(0).norm()
    spread_at_join = torch.stack([snapshots[14][u] for u in survivors]).std(0).norm()
    assert spread < 0.5 * spread_at_join


def test_periodic_average_equalises_survivors():
    snapshots = {}

    def between(start, members):
        snapshots[start] = {uid: flat(m) for uid, m in members.items()}

    members, _ = simulate_elastic(
        SIZE, 12, [Change(5, 0), Change(5, 7)], build=_build(), train_step=mix_only, schedule="ring",
        algorithm=lambda: PeriodicAverage(ExactGossip(), every=4), between=between,
    )  # fmt: skip
    survivors = list(range(1, 7))
    target = torch.stack([snapshots[5][u] for u in survivors]).mean(0)
    for uid in survivors:  # step 7 averaged the 6 survivors exactly; later steps mix equal replicas
        torch.testing.assert_close(flat(members[uid]), target, rtol=0, atol=1e-12)


def test_plan_refuses_impossible_changes():
    with pytest.raises(InvalidArgumentError, match="uid 9 is not a member"):
        plan_epochs(4, 10, [Change(3, 9)])
    with pytest.raises(InvalidArgumentError, match="no member is left"):
        plan_epochs(1, 10, [Change(3, 0)])
    with pytest.raises(InvalidArgumentError, match="not inside"):
        plan_epochs(4, 10, [Change(10, 1)])


def test_checkpoint_records_the_members(tmp_path):
    """ElasticRun passed in save_checkpoint's extra: the file says who the members were, and a load reads it back."""
    from types import SimpleNamespace

    from gossip import simulate
    from gossip.checkpoint import load_checkpoint, save_checkpoint
    from gossip.wrapper.elastic_run import ElasticRun

    def worker(comm):
        membership = SimpleNamespace(uid=[4, 7][comm.rank], epoch=3, current=SimpleNamespace(members=(4, 7)))
        model = DecentralizedDataParallel(nn.Linear(3, 2), comm, schedule_for("one_peer_hypercube", 2)[0],
                                          ExactGossip(), consensus_every=0)  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run = ElasticRun(model, optimizer, membership, schedule="one_peer_hypercube", algorithm=ExactGossip,
                         timeout=5.0)  # fmt: skip
        run.events.append({"epoch": 3, "left": {"2": "killed by SIGKILL"}})
        save_checkpoint(tmp_path, model, optimizer, extra={"membership": run})
        fresh = ElasticRun(model, optimizer, membership, schedule="one_peer_hypercube", algorithm=ExactGossip,
                           timeout=5.0)  # fmt: skip
        load_checkpoint(tmp_path, model, optimizer, extra={"membership": fresh})
        model.close()
        return fresh.restored

    for rank, restored in enumerate(simulate(2, worker)):
        assert restored == {"uid": [4, 7][rank], "epoch": 3, "members": [4, 7],
                            "events": [{"epoch": 3, "left": {"2": "killed by SIGKILL"}}]}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "after"),
    [("one_peer_hypercube", "base_graph (fallback"), ("random_matchings", "random_matchings")],
    ids=["periodic-fallback", "without-period"],
)
def test_no_collective_inside_a_step_after_a_change(monkeypatch, family, after):
    from gossip.backends.simulator import SimulatorCommunicator

    calls = []
    all_reduce = SimulatorCommunicator.all_reduce
    monkeypatch.setattr(SimulatorCommunicator, "all_reduce", lambda self, *a, **k: calls.append(self.rank) or
                        all_reduce(self, *a, **k))  # fmt: skip
    changes = [Change(4, 1), Change(4, 3), Change(4, 6)]  # 5 members: the Base-2 graph, or random matchings
    _, epochs = simulate_elastic(SIZE, 80, changes, build=_build(), train_step=mix_only, schedule=family,
                                 algorithm=ExactGossip)  # fmt: skip
    assert epochs[-1].schedule.startswith(after)
    assert calls == []  # before the fix: the agreement check's all-reduce at steps 39, 49, ... on every member


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"consensus_every": 10}, r"the wrapper samples the consensus distance every 10 steps.*consensus_every=0"),
        ({"consensus_every": 0, "buffers": "average"}, r"buffers='average'.*use buffers='local'"),
        (
            {"consensus_every": 0, "gradient_tracking": True, "tracking_overlap": True},
            r"tracking_overlap=True posts the trackers' exchange beside the parameters'.*use the blocking tracker",
        ),
    ],
)
def test_a_wrapper_with_a_collective_inside_its_step_is_refused(tmp_path, options, refusal):
    """A collective inside optimizer.step() after the update, which a change could interrupt, is refused up front."""
    from types import SimpleNamespace

    from gossip import simulate
    from gossip.errors import ElasticUnsupportedError
    from gossip.wrapper.elastic_run import ElasticRun

    def worker(comm):
        membership = SimpleNamespace(uid=comm.rank, epoch=0, current=SimpleNamespace(members=(0, 1)))
        wrapper_options = {key: value for key, value in options.items() if key != "optimizer"}
        model = DecentralizedDataParallel(nn.Linear(3, 2), comm, schedule_for("one_peer_hypercube", 2)[0],
                                          ExactGossip(), run_dir=tmp_path, **wrapper_options)  # fmt: skip
        if options.get("optimizer") == "momentum":
            optimizer: torch.optim.Optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=0.1)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            with pytest.raises(ElasticUnsupportedError, match=f"elastic: rank {comm.rank}: {refusal}"):
                ElasticRun(model, optimizer, membership, schedule="one_peer_hypercube", algorithm=ExactGossip,
                           timeout=5.0)  # fmt: skip
        finally:
            model.close()

    simulate(2, worker)
