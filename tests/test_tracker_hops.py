"""Several tracker hops a step (``DecentralizedDataParallel(..., tracker_hops=k)``, gossip.wrapper.tracking): step t
mixes the trackers over W(kt), ..., W(kt + k - 1) after adding the increments, on the simulator.

Pinned: the trackers equal the dense recursion y^t = W(2t + 1) W(2t) (y^{t-1} + g^t - g^{t-1}) at every step; on the
4-rank hypercube two hops are the exact average, so every rank holds the same tracker bit for bit; sign trackers keep
the sum and both ends of every edge hold bit-identical public copies; the bytes are k sign messages a step; resume
is bit-identical; every refusal names the rank and the setting (a bad count, overlap, no tracking, ranks that
disagree, elastic runs); the default pipeline and ``gossip-train`` mix the trackers ceil(log2(n) / 2) + 1 times above 8
workers. Gloo and MPI equal the simulator bit for bit in test_gradient_tracking_powergossip.py (cases
``sign-two-hops``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.parallel_scenarios import checkpoint_resume, make_mlp
from helpers.tracking_scenarios import EPS, STEPS, assert_trackers_sum_to_the_gradients, tracked_steps

import gossip
import topologies
from gossip.app.run_dir import plot_title
from gossip.app.train import ConfigError, TrainConfig, resolve
from gossip.app.train_elastic import resolve_elastic
from gossip.errors import ElasticUnsupportedError, InvalidArgumentError
from gossip.wrapper.elastic_run import check_wrapper
from gossip.wrapper.parallel import DecentralizedDataParallel
from gossip.wrapper.replicas import ReplicaMismatchError


def test_two_exact_hops_are_the_dense_recursion_over_w_2t_then_w_2t_plus_1():
    n = 8  # the hypercube's period is 3: W(2t), W(2t + 1) cycle through every dimension, in pairs that change
    per_rank = gossip.simulate(n, tracked_steps, "exact", True, hops=2)
    schedule = topologies.one_peer_hypercube(n)
    y = np.zeros((n, per_rank[0][0]["y"].numel()))
    previous = np.zeros_like(y)
    for step in range(STEPS):
        g = np.stack([rows[step]["g"].double().numpy() for rows in per_rank])
        y = schedule.mixing_matrix(2 * step + 1) @ schedule.mixing_matrix(2 * step) @ (y + g - previous)
        previous = g
        got = np.stack([rows[step]["y"].double().numpy() for rows in per_rank])
        tolerance = (step + 1) * 8 * EPS * max(np.abs(y).max(), np.abs(g).max())
        assert np.abs(got - y).max() <= tolerance, f"step {step}"
    assert_trackers_sum_to_the_gradients(per_rank)


def test_on_four_ranks_two_hypercube_hops_give_every_rank_the_same_tracker_the_mean_gradient():
    per_rank = gossip.simulate(4, tracked_steps, "exact", True, hops=2)
    one_hop = gossip.simulate(4, tracked_steps, "exact", True)
    for step in range(STEPS):
        for rank, rows in enumerate(per_rank):
            assert torch.equal(rows[step]["y"], per_rank[0][step]["y"]), f"step {step} rank {rank}"
        mean = torch.stack([rows[step]["g"] for rows in per_rank]).double().mean(0)
        gap = (per_rank[0][step]["y"].double() - mean).abs().max().item()
        assert gap <= (step + 1) * 8 * EPS * mean.abs().max().item(), f"step {step}: |y - mean g| = {gap:.3g}"
    # one hop leaves the ranks' trackers different: the second hop is what made them equal
    assert not torch.equal(one_hop[0][-1]["y"], one_hop[1][-1]["y"])


def _sign_trackers_and_their_copies(comm, hops: int) -> dict:
    rows = tracked_steps(comm, "powergossip", "sign", hops=hops, keep_model=True)
    model = rows.pop()
    public = {peer: [torch.cat(side) for side in sides] for peer, sides in model.tracker.mixing.public.items()}
    return {"rows": rows, "public": public}


def test_sign_trackers_with_two_hops_keep_the_sum_and_both_edge_ends_bit_identical():
    n = 8
    two = gossip.simulate(n, _sign_trackers_and_their_copies, 2)
    one = gossip.simulate(n, _sign_trackers_and_their_copies, 1)
    assert_trackers_sum_to_the_gradients([result["rows"] for result in two])
    for rank, result in enumerate(two):
        assert sorted(result["public"]) == sorted([rank ^ 1, rank ^ 2, rank ^ 4])  # every dimension was a hop
        for peer, (mine, theirs) in result["public"].items():
            # what this rank thinks peer knows of it is what peer holds of this rank, and the other way round
            assert torch.equal(mine, two[peer]["public"][rank][1]), f"rank {rank} peer {peer}"
            assert torch.equal(theirs, two[peer]["public"][rank][0]), f"rank {rank} peer {peer}"
    numel = two[0]["rows"][0]["x"].numel()
    message = 3 * -(-numel // 8) + 4 * 4 * -(-numel // 256)  # 3 bits a value, four float32 scales per 256
    for rank in range(n):
        extra = [a["bytes_sent"] - b["bytes_sent"] for a, b in zip(two[rank]["rows"], one[rank]["rows"], strict=True)]
        assert extra == [message] * STEPS, f"rank {rank}"  # one more sign message a step
    assert not torch.equal(two[0]["rows"][-1]["y"], one[0]["rows"][-1]["y"])


def test_resume_with_two_tracker_hops_is_bit_identical(tmp_path):
    results = gossip.simulate(
        4, checkpoint_resume, tmp_path, gossip.PowerGossip, False, gradient_tracking="sign", tracker_hops=2
    )
    for rank, result in enumerate(results):
        assert result["resumed_at"] == 3
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def _refusal(comm, **kwargs) -> str:
    try:
        DecentralizedDataParallel(
            make_mlp(comm.rank), comm, topologies.one_peer_hypercube(comm.size), gossip.ExactGossip(), **kwargs
        )
    except (InvalidArgumentError, ReplicaMismatchError) as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("hops", [0, -1, 1.5, True, "2"])
def test_a_hop_count_that_is_not_a_positive_integer_is_refused_on_every_rank(hops):
    for rank, message in enumerate(gossip.simulate(2, _refusal, gradient_tracking="sign", tracker_hops=hops)):
        assert message == f"rank {rank}: tracker_hops must be an integer >= 1, got {hops!r}"


def test_hops_with_the_overlapped_tracker_or_without_tracking_are_refused():
    overlapped = gossip.simulate(2, _refusal, gradient_tracking=True, tracking_overlap=True, tracker_hops=2)
    untracked = gossip.simulate(2, _refusal, tracker_hops=3)
    for rank in range(2):
        assert overlapped[rank].startswith(f"rank {rank}: tracker_hops=2 mixes the trackers after the step's")
        assert "tracking_overlap=True" in overlapped[rank]
        assert untracked[rank].startswith(f"rank {rank}: tracker_hops=3 mixes the trackers several times a step")
        assert "gradient_tracking is off" in untracked[rank]


def test_ranks_that_disagree_on_the_hops_are_named():
    def run(comm) -> str:
        return _refusal(comm, gradient_tracking="sign", tracker_hops=2 if comm.rank == 3 else 1)

    messages = gossip.simulate(4, run)
    expected = "rank 3 uses tracker_hops=2 but rank 0 uses 1; pass the same tracker_hops on every rank"
    assert messages == [expected] * 4


def test_elastic_runs_refuse_more_than_one_hop():
    def run(comm) -> str:
        model = DecentralizedDataParallel(
            make_mlp(comm.rank), comm, topologies.one_peer_hypercube(comm.size), gossip.ExactGossip(),
            consensus_every=0, gradient_tracking="sign", tracker_hops=2, mean_gradient="allreduce",
        )  # fmt: skip
        try:
            check_wrapper(model)
        except ElasticUnsupportedError as error:
            return str(error)
        finally:
            model.close()
        return "accepted"

    for rank, message in enumerate(gossip.simulate(2, run)):
        assert message.startswith(f"elastic: rank {rank}: tracker_hops=2 runs the trackers' exchange 2 times")
    with pytest.raises(ConfigError, match="--tracker-hops"):
        resolve_elastic(TrainConfig(tracker_hops=2), 4)
    assert resolve_elastic(TrainConfig(), 4)[0].tracker_hops == 1


def test_the_default_pipeline_and_the_main_job_mix_the_trackers_one_more_than_half_the_exact_averages_hops():
    sizes = (1, 2, 8, 9, 12, 16, 17, 64, 65, 96, 256, 257, 1024)
    assert [gossip.default_tracker_hops(n) for n in sizes] == [1, 1, 1, 3, 3, 3, 4, 4, 5, 5, 5, 6, 6]
    for n in range(9, 4100):  # the fewest k with 2^k >= 2 sqrt(n): ceil(log2(n) / 2) + 1
        k = gossip.default_tracker_hops(n)
        assert 4 ** (k - 2) < n <= 4 ** (k - 1) and k == math.ceil(math.log2(n) / 2) + 1, n
    assert gossip.Pipeline().tracker_hops is None and gossip.Pipeline(tracker_hops=3).hops(4) == 3
    with pytest.raises(InvalidArgumentError, match="Pipeline: tracker_hops must be an integer >= 1, got 0"):
        gossip.Pipeline(tracker_hops=0)

    def wrapped_hops(comm) -> int:
        model, _ = gossip.wrap(make_mlp(comm.rank), comm, lr=1e-3)
        model.close()
        return model.tracker.hops

    assert gossip.simulate(8, wrapped_hops) == [1] * 8
    assert gossip.simulate(16, wrapped_hops) == [3] * 16
    assert resolve(TrainConfig(), 8)[0].tracker_hops == 1
    sixteen = resolve(TrainConfig(steps=300), 16)[0]
    assert sixteen.tracker_hops == 3 and "sign trackers of the first moments (3 hops a step)" in plot_title(sixteen)
    assert resolve(TrainConfig(steps=300), 64)[0].tracker_hops == 4
    assert resolve(TrainConfig(tracker_hops=3), 4)[0].tracker_hops == 3
    assert resolve(TrainConfig(gradient_tracking=True, tracking_overlap=True), 16)[0].tracker_hops == 1
    assert resolve(TrainConfig(gradient_tracking=False, optimizer="adamw"), 16)[0].tracker_hops == 1
    with pytest.raises(ConfigError, match="--tracker-hops"):
        resolve(TrainConfig(gradient_tracking=True, tracking_overlap=True, tracker_hops=2), 4)
    with pytest.raises(ConfigError, match="--tracker-hops"):
        resolve(TrainConfig(gradient_tracking=False, optimizer="adamw", tracker_hops=2), 4)
