"""Gradient tracking across membership changes (gossip.wrapper.elastic.rebind, on the simulator).

Properties pinned, deterministically, with exact, PowerGossip and scaled-sign trackers, under AdamW on the trackers
and under momentum tracking (MomentumTrackingAdamW without the mean gradient's sample):

* at every step, before and after a departure and a join, the members' trackers sum to the members' last inputs
  (their gradients, or their first moments), sum_i y_i = sum_i g_i: the trackers restart at each change;
* the departed member held a share y_k - g_k that was not zero (so the restart is what keeps the sum);
* under AdamW a member's last input is exactly its own gradient of that step;
* trackers given as an algorithm object cannot be remade: rebind refuses them by name unless given a fresh one;
* optimizer.step() interrupted in the trackers' wait and called again resumes the same exchange: bit-identical to an
  uninterrupted run, the first moment advanced once (what an elastic run's completed step relies on);
* a joiner whose optimizer is not of its donor's kind (a momentum source beside AdamW) is refused at the hand-over
  (it cannot take part in the ranks' agreement at the first step).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import optim
from gossip import DecentralizedDataParallel, ExactGossip, PowerGossip, simulate
from gossip.errors import ElasticUnsupportedError, MembershipChangedError, ReplicaMismatchError
from gossip.wrapper.elastic import rebind, schedule_for, solo_communicator
from gossip.wrapper.elastic_sim import Change, Member, simulate_elastic

SIZE, STEPS = 8, 24
CHANGES = [Change(8, 3), Change(16, 3, join=True)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).clone()


def make_builder(tracking: str, optimizer: str):
    def build(comm, schedule, algorithm, uid):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4)).double()
        model = DecentralizedDataParallel(net, comm, schedule, algorithm, consensus_every=0,
                                          gradient_tracking=tracking)  # fmt: skip
        if optimizer == "momentum":
            opt: torch.optim.Optimizer = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, second_moment_every=0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return Member(uid, model, opt)

    return build


@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
@pytest.mark.parametrize("tracking", ["exact", "powergossip", "sign"])
def test_trackers_sum_to_the_members_inputs_across_departure_and_join(tracking, optimizer):
    rows: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # step -> uid -> (y_i, g_i)

    def train(member: Member, step: int) -> None:
        model, uid = member.model, member.uid
        x = torch.linspace(-1, 1, 12, dtype=torch.float64).view(2, 6) * (uid + 1) + step
        model(x).square().mean().backward()
        gradient = flat(p.grad for p in model.parameters())
        member.optimizer.step()
        member.optimizer.zero_grad()
        tracker = model.tracker
        y = flat(t.buffer for t in tracker.trackers)
        g = flat(tracker.previous)
        if optimizer == "adamw":
            torch.testing.assert_close(g, gradient, rtol=0, atol=0)  # the tracker's input is this step's gradient
        rows.setdefault(step, {})[uid] = (y, g)

    _, epochs = simulate_elastic(SIZE, STEPS, CHANGES, build=make_builder(tracking, optimizer), train_step=train,
                                 schedule="one_peer_hypercube", algorithm=ExactGossip)  # fmt: skip
    assert [len(e.members) for e in epochs] == [8, 7, 8]
    departed_share = rows[7][3][0] - rows[7][3][1]
    assert departed_share.abs().max() > 1e-3  # what the departed member took with it
    for epoch in epochs:
        for step in range(epoch.start, epoch.stop):
            ys = torch.stack([rows[step][uid][0] for uid in epoch.members])
            gs = torch.stack([rows[step][uid][1] for uid in epoch.members])
            assert set(rows[step]) == set(epoch.members)
            torch.testing.assert_close(ys.sum(0), gs.sum(0), rtol=0, atol=1e-12, msg=f"step {step}")
    # the trackers are not each rank's own input: the mixing moved them (the check above is not trivial)
    y, g = rows[STEPS - 1][0]
    assert (y - g).abs().max() > 1e-6


def test_trackers_given_as_an_object_need_a_fresh_one_at_a_change():
    def worker(comm):
        schedule = schedule_for("one_peer_hypercube", 2)[0]
        model = DecentralizedDataParallel(nn.Linear(3, 2), comm, schedule, ExactGossip(), consensus_every=0,
                                          gradient_tracking=PowerGossip(rank=1))  # fmt: skip
        solo, one = solo_communicator(), schedule_for("one_peer_hypercube", 1)[0]
        try:
            with pytest.raises(ElasticUnsupportedError, match=f"rank {comm.rank}: .*algorithm object PowerGossip"):
                rebind(model, solo, one, ExactGossip())
            rebind(model, solo, one, ExactGossip(), PowerGossip(rank=1))
            assert model.tracker.mixing.comm is solo and model.comm is solo
        finally:
            model.close()

    simulate(2, worker)


def test_a_joiner_with_another_optimizer_kind_is_refused_at_the_hand_over():
    plain, momentum = make_builder("exact", "adamw"), make_builder("exact", "momentum")

    def build(comm, schedule, algorithm, uid):
        return (momentum if uid == 9 else plain)(comm, schedule, algorithm, uid)

    def train(member: Member, step: int) -> None:
        member.model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
        member.optimizer.step()
        member.optimizer.zero_grad()

    with pytest.raises(ReplicaMismatchError, match=r"elastic: rank \d joins with MomentumTrackingAdamW.* donor rank"):
        simulate_elastic(4, 6, [Change(3, 9, join=True)], build=build, train_step=train, schedule="ring",
                         algorithm=ExactGossip)  # fmt: skip


@pytest.mark.parametrize("tracking", ["exact", "sign"])
def test_an_interrupted_trackers_wait_resumes_and_runs_each_part_once(tracking):
    """What an elastic run's completed step relies on: optimizer.step() raising inside the trackers' wait (a change
    noticed there) and called again finishes the same exchange, without mixing or preparing the moment twice.

    Rank 0's first wait on the trackers' exchange at step 3 raises MembershipChangedError before waiting; its retry
    must end every rank's run bit-identical to an uninterrupted one, under momentum tracking.
    """

    def run(interrupt: bool) -> list[torch.Tensor]:
        results: dict[int, torch.Tensor] = {}

        def worker(comm):
            net = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4)).double()
            with torch.no_grad():  # not from the RNG, which the simulator's rank threads share
                for parameter in net.parameters():
                    parameter.copy_(torch.linspace(-0.5, 0.5, parameter.numel()).view_as(parameter))
            model = DecentralizedDataParallel(net, comm, schedule_for("one_peer_hypercube", 2)[0], ExactGossip(),
                                              consensus_every=0, gradient_tracking=tracking)  # fmt: skip
            opt = optim.MomentumTrackingAdamW(model.parameters(), lr=1e-2, second_moment_every=2)
            mixing, interrupted = model.tracker.mixing, []
            finish_step = mixing._finish_step

            def flaky_finish_step(pending):
                if interrupt and comm.rank == 0 and model.step_count == 3 and not interrupted:
                    interrupted.append(True)
                    raise MembershipChangedError("rank 0: a change noticed in the trackers' wait (test)")
                return finish_step(pending)

            mixing._finish_step = flaky_finish_step
            for step in range(6):
                x = torch.linspace(-1, 1, 12, dtype=torch.float64).view(2, 6) * (comm.rank + 1) + step
                model(x).square().mean().backward()
                try:
                    opt.step()
                except MembershipChangedError:
                    opt.step()  # as ElasticRun.update does for a step completed on the old group
                opt.zero_grad()
            assert interrupted == ([True] if interrupt and comm.rank == 0 else [])
            assert opt.state[next(model.parameters())]["step"] == 6  # the first moment advanced once a step
            results[comm.rank] = torch.cat([flat(b.buffer for b in model.buckets),
                                            flat(t.buffer for t in model.tracker.trackers)])  # fmt: skip
            model.close()

        simulate(2, worker)
        return [results[0], results[1]]

    for plain, resumed in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(resumed, plain, rtol=0, atol=0)
