"""PowerGossip(delayed_last_iteration=True): the last power iteration of step t applied at step t + 1's finish.

Properties: the sum over ranks is preserved after every step; both ends of every edge hold the same factors; an
edge the next step uses again is applied at once, so on schedules that always reuse their edges the result is bit
for bit the undelayed one; the delayed exchange is in flight between two steps (its wait is not at the step that
posted it); close() completes and drops it; the settings that cannot delay are refused. The wrapper's resume with a
delayed exchange in flight, and Gloo and MPI against the simulator: tests/test_parallel_multiprocess.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.algorithm_scenarios import local_model
from helpers.parallel_scenarios import batch, checkpoint_resume, loss_of, make_mlp, train, wrap

import gossip
import topologies
from gossip.algorithms import PowerGossipTuning
from gossip.errors import InvalidArgumentError


def delayed(**kwargs) -> gossip.PowerGossip:
    return gossip.PowerGossip(rank=2, num_iterations=2, min_compression=1, delayed_last_iteration=True, **kwargs)


def mix(comm: gossip.Communicator, schedule: str, delay: bool, steps: int = 12) -> dict:
    buckets = local_model(comm.rank)
    algo = delayed() if delay else gossip.PowerGossip(rank=2, num_iterations=2, min_compression=1)
    make = {"hypercube": topologies.one_peer_hypercube, "ring": topologies.ring}[schedule]
    algo.setup(comm, make(comm.size), buckets)
    sums, kept = [], []
    for step in range(steps):
        algo.step(step)
        total = torch.cat([b.buffer.double() for b in buckets])
        comm.all_reduce(total)
        sums.append(total)
        kept.append(algo._delayed is not None)
    algo.drain()
    return {
        "buffers": [b.buffer.clone() for b in buckets],
        "sums": sums,
        "kept": kept,
        "factors": {key: [t.clone() for t in e.p + e.q] for key, e in algo.edges.items()},
    }


def test_the_sum_over_ranks_is_preserved_after_every_step_and_both_ends_share_the_factors():
    results = gossip.simulate(8, mix, "hypercube", True)
    initial = sum(torch.cat([b.buffer.double() for b in local_model(rank)]) for rank in range(8))
    for rank, result in enumerate(results):
        assert all(result["kept"]), "on the one-peer hypercube of 8 the next step never reuses an edge"
        for total in result["sums"]:
            torch.testing.assert_close(total, initial, rtol=0, atol=1e-4)
        for (lo, hi), factors in result["factors"].items():
            theirs = results[hi if rank == lo else lo]["factors"][(lo, hi)]
            assert all(torch.equal(a, b) for a, b in zip(factors, theirs, strict=True)), (rank, lo, hi)


def test_delaying_changes_the_result_where_the_next_step_uses_other_edges():
    got = gossip.simulate(4, mix, "hypercube", True)
    undelayed = gossip.simulate(4, mix, "hypercube", False)
    assert not all(
        torch.equal(x, y)
        for a, b in zip(got, undelayed, strict=True)
        for x, y in zip(a["buffers"], b["buffers"], strict=True)
    )


@pytest.mark.parametrize(("size", "schedule"), [(2, "hypercube"), (4, "ring")])
def test_an_edge_the_next_step_uses_again_is_applied_at_once_so_nothing_changes(size, schedule):
    got = gossip.simulate(size, mix, schedule, True)
    undelayed = gossip.simulate(size, mix, schedule, False)
    for rank, (a, b) in enumerate(zip(got, undelayed, strict=True)):
        assert not any(a["kept"]), rank
        assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"], strict=True)), rank


def posted_and_waited(comm: gossip.Communicator) -> list[tuple[int, bool, bool]]:
    """Per step: whether the delayed round exists after finish, and whether its exchange had completed then."""
    buckets = local_model(comm.rank)
    algo = delayed()
    algo.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    seen = []
    for step in range(4):
        algo.step(step)
        seen.append((algo._delayed.step, algo._delayed.handle is not None, algo._delayed.seq == 2 * step + 1))
    algo.drain()
    assert algo._delayed is None
    return seen


def test_the_delayed_round_is_the_steps_last_iteration_kept_until_the_next_finish():
    for seen in gossip.simulate(4, posted_and_waited):
        assert seen == [(step, True, True) for step in range(4)]


def test_training_with_the_delay_follows_the_undelayed_run_and_close_ends_every_rank():
    def run(delay: bool):
        def make() -> gossip.PowerGossip:
            return gossip.PowerGossip(rank=2, num_iterations=2, min_compression=1, delayed_last_iteration=delay)

        return gossip.simulate(4, lambda comm: train(comm, 12, algorithm=make()), timeout=30.0)

    def late_loss(results) -> float:  # the mean over ranks of the last 4 steps' losses
        return sum(sum(r["losses"][-4:]) for r in results) / 16

    got, undelayed = run(True), run(False)  # close() returned on every rank: the delayed exchange completed
    assert late_loss(got) == pytest.approx(late_loss(undelayed), rel=0.02)
    assert got[0]["params"].shape == undelayed[0]["params"].shape
    assert not all(torch.equal(a["params"], b["params"]) for a, b in zip(got, undelayed, strict=True))


def test_resume_with_a_delayed_exchange_in_flight_is_bit_identical(tmp_path):
    results = gossip.simulate(4, checkpoint_resume, tmp_path, delayed)
    for rank, result in enumerate(results):
        assert result["resumed_at"] == 3
        assert torch.equal(result["resumed"], result["uninterrupted"]), rank


def test_settings_that_cannot_delay_are_refused():
    with pytest.raises(InvalidArgumentError, match="delayed_last_iteration needs num_iterations >= 2"):
        gossip.PowerGossip(num_iterations=1, delayed_last_iteration=True)
    with pytest.raises(InvalidArgumentError, match="uncompressed_every_iteration"):
        gossip.PowerGossip(
            num_iterations=2,
            delayed_last_iteration=True,
            tuning=PowerGossipTuning(uncompressed_every_iteration=True),
        )

    def bind(comm, make):
        make().setup(comm, topologies.one_peer_hypercube(comm.size), local_model(comm.rank))

    with pytest.raises(InvalidArgumentError, match="PeriodicAverage does not pass a delayed exchange on"):
        gossip.simulate(2, bind, lambda: gossip.PeriodicAverage(delayed(), every=4))
    with pytest.raises(InvalidArgumentError, match="AdaptivePowerGossip does not pass a delayed exchange on"):
        gossip.simulate(
            2, bind, lambda: gossip.AdaptivePowerGossip(ladder=(1, 2), num_iterations=2, delayed_last_iteration=True)
        )


def test_the_setting_is_part_of_the_config_that_ranks_and_checkpoints_compare():
    assert delayed().config()["delayed_last_iteration"] is True
    # off: the config has its previous keys, so checkpoints written before the setting existed still load
    assert "delayed_last_iteration" not in gossip.PowerGossip(num_iterations=2).config()


def state_after_three_steps(comm: gossip.Communicator) -> tuple[list[str], int]:
    model = wrap(comm, make_mlp(comm.rank), delayed())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.training_state()
    model.close()
    return sorted(state), state["algorithm_in_flight"]["step"]


def test_a_checkpoint_holds_the_delayed_exchange_of_the_previous_step():
    for keys, step in gossip.simulate(4, state_after_three_steps):
        assert keys == ["algorithm", "algorithm_in_flight", "buckets", "step"]
        assert step == 2  # step 2's last iteration, applied at step 3's finish
