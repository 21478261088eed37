"""Gossip between FSDP2-sharded replicas (2 replicas x 2 shards, Gloo on CPU): one 4-process job, its properties.

The worker (tests/helpers/sharded_worker.py) runs every phase in one launch; rank r is replica r // 2, shard r % 2,
so ranks j and j + 2 form lane j. Its model, Linear(16, 11) - Tanh - Linear(11, 1), is sharded unevenly: 6 + 5
rows, and a 1-row layer whose second shard is empty.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.launch import launch

N = 4
PAIRS = [(0, 2), (1, 3)]  # the two ranks of each lane: replica 0's and replica 1's


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    return launch("sharded_worker.py", tmp_path_factory.mktemp("sharded"), [], backend="gloo", n=N)[0]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-6) -> bool:
    return all(torch.allclose(x, y, rtol=0.0, atol=atol) for x, y in zip(a, b, strict=True))


def test_unsharded_wrapper_refuses_dtensor_parameters_by_name(per_rank):
    for result in per_rank:
        assert result["refusal"].startswith("ShardedLayoutError"), result["refusal"]
        assert "ShardedDecentralizedDataParallel" in result["refusal"]


def test_exact_gossip_preserves_the_sum_over_replicas_and_averages_them(per_rank):
    for rank in range(N):
        before = [sum(per_rank[r]["before"][i] for r in (rank % 2, rank % 2 + 2)) for i in range(4)]
        after = [sum(per_rank[r]["after"][i] for r in (rank % 2, rank % 2 + 2)) for i in range(4)]
        assert all(torch.allclose(a, b) for a, b in zip(after, before, strict=True)), rank
        assert not torch.equal(per_rank[0]["before"][0], per_rank[2]["before"][0])  # the replicas differed
        assert all(torch.allclose(a, b) for a, b in zip(per_rank[0]["after"], per_rank[2]["after"], strict=True))
        assert per_rank[rank]["consensus"] < 1e-6


def test_mixed_parameters_stay_the_same_shard0_dtensors(per_rank):
    for result in per_rank:
        assert result["same_objects"] and result["same_storage"]
        assert result["placements"] == ["(Shard(dim=0),)"] * 4


def test_without_gossip_the_replicas_differ_and_each_equals_its_unsharded_twin(per_rank):
    # FSDP2 over mesh["shard"] only: a replica's shards train as one unsharded model on its shards' batches ...
    for result in per_rank:
        assert _close(result["plain"], result["plain_reference"]), result["replica"]
    # ... and the replicas, on different batches, are never averaged with each other (that would be HSDP, DDP)
    for left, right in PAIRS:
        pairs = zip(per_rank[left]["plain"], per_rank[right]["plain"], strict=True)
        assert not any(torch.allclose(a, b) for a, b in pairs)
    # the two shards of a replica see the same full parameters
    assert _close(per_rank[0]["plain"], per_rank[1]["plain"], atol=0.0)
    assert _close(per_rank[2]["plain"], per_rank[3]["plain"], atol=0.0)


def test_exact_gossip_sharded_equals_unsharded_gossip_of_the_same_replicas(per_rank):
    # x_i <- sum_k W_ik x_k - lr g_i, W = [[.75, .25], [.25, .75]], computed on unsharded replicas in the worker
    for result in per_rank:
        run = result["exact"]
        for step, (full, expected) in enumerate(zip(run["full"], run["expected_full"], strict=True)):
            assert _close(full, expected), (result["replica"], result["shard"], step)
    last = [per_rank[r]["exact"]["full"][-1] for r in range(N)]
    assert not _close(last[0], last[2], atol=1e-3)  # W is not the average: the replicas still differ


def test_the_next_forward_sees_the_mixed_values(per_rank):
    for result in per_rank:
        run = result["exact"]
        # each step's forward against the unsharded replica at the same step (step 0: before any mixing)
        assert _close(run["outputs"], run["expected_outputs"]), (result["replica"], result["shard"])
        plain, sharded = result["mixed_forward"]  # a plain model loaded with the mixed full state, and the shards
        assert torch.equal(plain, sharded)


def test_averaged_holds_the_mean_of_the_replicas_and_restores_each_replica_exactly(per_rank):
    for left, right in PAIRS:
        replicas = per_rank[left]["exact"]["full"][-1], per_rank[right]["exact"]["full"][-1]
        mean = [(a + b) / 2 for a, b in zip(*replicas, strict=True)]
        for rank in (left, right):
            assert _close(per_rank[rank]["averaged"], mean)
            after, own = per_rank[rank]["after_averaged"], per_rank[rank]["exact"]["full"][-1]
            assert all(torch.equal(a, b) for a, b in zip(after, own, strict=True))


def test_fsdp2_runs_the_shards_post_accumulate_grad_hooks(per_rank):
    # FSDP2 assigns the reduce-scattered gradient to the sharded parameter and then runs its post-accumulate-grad
    # hooks: the wrapper's backward hooks (skipped-step detection, PowerGossip's progress) see every backward
    for result in per_rank:
        assert result["plain_grads_set"]
        assert result["plain_hooks_fired"] == 4  # one per parameter of the first backward
        assert result["backward_seen"]


def test_a_step_skipped_on_one_replica_still_mixes_and_keeps_the_lanes_in_lockstep(per_rank):
    # replica 1 ran a backward and cleared its gradients without optimizer.step(): it mixed, then both stepped on
    assert [result["steps_after_skip"] for result in per_rank] == [5] * N


def test_powergossip_block_mode_compresses_each_local_shard(per_rank):
    for result in per_rank:
        assert result["power_compressed"] == ["0.weight"]  # its 6 x 16 or 5 x 16 shard; the others travel exactly
        rows = 6 if result["shard"] == 0 else 5  # the local rows of 11, rank 1: a block of its own
        assert [tuple(p.shape) for p in result["power"][0]["p"]] == [(rows, 1)]
        assert [tuple(q.shape) for q in result["power"][0]["q"]] == [(16, 1)]


def test_powergossip_on_shards_both_ends_of_an_edge_hold_bit_identical_factors(per_rank):
    for left, right in PAIRS:
        for step, (a, b) in enumerate(zip(per_rank[left]["power"], per_rank[right]["power"], strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a["p"], b["p"], strict=True)), (left, step)
            assert all(torch.equal(x, y) for x, y in zip(a["q"], b["q"], strict=True)), (left, step)


def test_powergossip_on_shards_moves_both_ends_by_one_difference_and_keeps_the_sum(per_rank):
    for left, right in PAIRS:
        for a, b in zip(per_rank[left]["power"], per_rank[right]["power"], strict=True):
            moved_a = [x - y for x, y in zip(a["after"], a["before"], strict=True)]
            moved_b = [x - y for x, y in zip(b["after"], b["before"], strict=True)]
            assert max(m.abs().max() for m in moved_a) > 0.1  # it mixed
            assert _close(moved_a, [-m for m in moved_b])  # the same decoded difference, opposite signs
            total_after = [x + y for x, y in zip(a["after"], b["after"], strict=True)]
            total_before = [x + y for x, y in zip(a["before"], b["before"], strict=True)]
            assert _close(total_after, total_before)


def test_resume_from_a_sharded_dcp_checkpoint_is_bit_exact(per_rank):
    # PowerGossip, gradient tracking, AdamW: 2 steps, save, 2 more; a fresh run loads and runs the same 2 steps
    for result in per_rank:
        assert result["resumed_at_step"] == 2 and result["progress"] == {"epoch": 3}
        assert all(torch.equal(a, b) for a, b in zip(result["loaded"], result["saved_at"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(result["resumed"], result["uninterrupted"], strict=True))
        assert all(
            torch.equal(a, b) for a, b in zip(result["resumed_local"], result["uninterrupted_local"], strict=True)
        )
        assert not _close(result["uninterrupted"], result["saved_at"], atol=1e-3)  # it trained after the save
        assert result["directories"] == ["replica0.dcp", "replica1.dcp"]  # one DCP checkpoint per replica
    assert not _close(per_rank[0]["saved_at"], per_rank[2]["saved_at"], atol=1e-3)  # the replicas differed


def test_the_pipelines_parts_on_shards_resume_bit_exact_with_a_mean_gradient_sample_in_progress(per_rank):
    for result in per_rank:
        run = result["pipeline_resume"]
        assert (run["resumed_at"], run["samples"], run["trackers"]) == (3, 1, "ChocoSign")
        assert all(torch.equal(a, b) for a, b in zip(run["resumed"], run["uninterrupted"], strict=True))
    assert not _close(per_rank[0]["pipeline_resume"]["resumed"], per_rank[2]["pipeline_resume"]["resumed"], atol=1e-4)


def test_a_replica_checkpoint_holds_its_sharded_parameters_for_any_dcp_reader(per_rank):
    import torch.distributed.checkpoint as dcp

    directory = per_rank[0]["checkpoint_dir"]
    for replica in range(2):
        path = f"{directory}/replica{replica}.dcp"
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        assert tuple(keys["parameters.0.weight"].size) == (11, 16)  # the global shape, from both shards
        assert tuple(keys["optimizer.state.0.exp_avg"].size) == (11, 16)
        assert {"lane0.gossip.structure", "lane1.gossip.structure"} <= set(keys)
        weight = torch.empty(11, 16)  # one process, no process group, the full tensor from the shards
        with warnings.catch_warnings():  # DCP says it assumes one process: that is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"parameters.0.weight": weight}, checkpoint_id=path, no_dist=True)
        assert torch.equal(weight, per_rank[2 * replica]["saved_at"][0])


def test_loading_a_missing_sharded_checkpoint_is_refused_on_every_rank(per_rank):
    for result in per_rank:
        assert result["missing"].startswith("CheckpointMismatchError"), result["missing"]
        assert "no checkpoint directory" in result["missing"] and "save_sharded_dcp" in result["missing"]


REFUSALS = {  # what each refusal raises, and what its message must say (what is wrong, what to do)
    "hsdp": ("ShardedLayoutError", ["2-D mesh", "HSDP", "mesh=mesh['shard']"]),
    "other_group": ("ShardedLayoutError", ["is sharded over ranks", "mesh=mesh['shard']"]),
    "plain": ("ShardedLayoutError", ["not sharded", "fully_shard(model, mesh=mesh['shard'])"]),
    "lane_settings": ("ShardedLayoutError", ["lane 1 uses seed=1", "same schedule, algorithm and settings"]),
    "lane_schedule": ("ShardedLayoutError", ["lane 1 uses schedule w", "lane 0 uses ring"]),
    "mesh_1d": ("ShardedLayoutError", ["2-D DeviceMesh", "init_device_mesh"]),
    "not_lanes": ("InvalidArgumentError", ["gossip.init_lanes(mesh)"]),
    "save_checkpoint": ("ArgumentTypeError", ["save_sharded_dcp", "overwrite"]),
    "save_dcp": ("ArgumentTypeError", ["save_sharded_dcp", "overwrite"]),
    "unsharded_to_sharded_save": ("ArgumentTypeError", ["ShardedDecentralizedDataParallel", "save_dcp"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_names_its_error_where_and_what_to_do(per_rank, case):
    kind, phrases = REFUSALS[case]
    for rank, result in enumerate(per_rank):
        message = result["refused"][case]
        assert message.startswith(f"{kind}: "), (rank, message)
        assert all(phrase in message for phrase in phrases), (rank, message)
        if case in ("hsdp", "other_group", "plain", "mesh_1d"):
            assert f"rank {rank}:" in message, message
        if case in ("hsdp", "other_group", "plain"):
            assert "parameter '0.weight'" in message, message
        if case.startswith("lane_"):
            assert f"replica {rank // 2}:" in message


def test_the_lanes_stay_in_lockstep_after_the_refusals(per_rank):
    assert [result["steps_after_refusals"] for result in per_rank] == [2] * N


def test_gradient_tracking_on_shards_equals_unsharded_tracking_of_the_same_replicas(per_rank):
    # y_i <- sum_k W_ik (y_k + g_k - g_k^prev), x_i <- sum_k W_ik x_k - lr y_i, on unsharded replicas in the worker
    for result in per_rank:
        run = result["tracking"]
        for step in range(3):
            assert _close(run["tracker"][step], run["expected_tracker"][step]), (result["replica"], step)
            assert _close(run["full"][step], run["expected_full"][step]), (result["replica"], step)


def test_gradient_tracking_on_shards_keeps_the_sum_of_trackers_equal_to_the_sum_of_gradients(per_rank):
    for left, right in PAIRS:
        a, b = per_rank[left]["tracking"], per_rank[right]["tracking"]
        for step in range(3):
            trackers = [x + y for x, y in zip(a["tracker"][step], b["tracker"][step], strict=True)]
            gradients = [x + y for x, y in zip(a["gradients"][step], b["gradients"][step], strict=True)]
            assert _close(trackers, gradients), step
        assert not _close(a["tracker"][2], b["tracker"][2], atol=1e-4)  # W is not the average: y_i differ


def test_momentum_tracking_on_shards_equals_the_unsharded_wrappers_momentum_tracking_of_the_same_replicas(per_rank):
    for result in per_rank:
        run = result["momentum"]
        assert run["samples"][3:5] == [0, 1]  # step 0's sample, averaged over 4 hops, divides steps 4 to 7
        for step, (full, expected) in enumerate(zip(run["full"], run["expected_full"], strict=True)):
            assert _close(full, expected, atol=1e-6), (result["replica"], step)
    assert not _close(per_rank[0]["momentum"]["full"][-1], per_rank[2]["momentum"]["full"][-1], atol=1e-4)


def test_a_frozen_sharded_parameter_starts_from_replica_0s_values(per_rank):
    for result in per_rank:
        assert result["frozen_placement"] == "(Shard(dim=0),)"
        assert torch.equal(result["frozen_after"], per_rank[0]["frozen_before"])
    assert not torch.equal(per_rank[2]["frozen_before"], per_rank[0]["frozen_before"])  # replica 1's differed


def test_loading_another_runs_sharded_checkpoint_is_refused_naming_the_difference(per_rank):
    for result in per_rank:
        assert result["other_run"].startswith("CheckpointMismatchError"), result["other_run"]
        assert result["other_run"].count("rank 0") == 1 and "(replica 0, shard 0)" in result["other_run"]
        assert "this run uses algorithm" in result["other_run"] and "'rank': 2" in result["other_run"]


def test_a_parameter_no_step_reaches_counts_every_step_as_a_zero_gradient_on_the_shards(per_rank):
    """Sign trackers and momentum tracking on FSDP2 shards, with a head no forward reaches: every parameter's first
    moment counts the 4 steps and every replica stays finite (no bias correction of 1 - beta^0)."""
    for rank, result in enumerate(per_rank):
        unreached = result["unreached"]
        assert set(unreached["steps"].values()) == {4}, (rank, unreached["steps"])
        assert all(unreached["finite"].values()), (rank, unreached["finite"])
        assert "unused.weight" in unreached["steps"]
