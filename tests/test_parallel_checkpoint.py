"""Checkpoint and resume (gossip.checkpoint) on the simulator: bit-identical continuation and refusal of a
checkpoint from another run. The same resume scenario runs on Gloo and MPI in test_parallel_multiprocess.py."""

from __future__ import annotations

import pytest
import torch
from helpers.parallel_scenarios import batch, checkpoint_resume, loss_of, make_mlp, weights_flip_on_rank_1, wrap
from torch import nn

import gossip
import topologies
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip
from gossip.checkpoint import (
    CheckpointMismatchError,
    checkpoint_path,
    dcp_path,
    load_checkpoint,
    read_checkpoint,
    read_dcp,
    save_checkpoint,
)
from gossip.errors import GossipError
from gossip.wrapper.parallel import DecentralizedDataParallel

N = 4


@pytest.mark.parametrize("algorithm", [ExactGossip, PowerGossip], ids=["exact", "powergossip"])
def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(tmp_path, algorithm):
    for rank, result in enumerate(gossip.simulate(N, checkpoint_resume, tmp_path, algorithm)):
        assert result["resumed_at"] == 3
        assert result["restored"] == {"batches": 3, "lr": 1e-2 / 4}  # the dict and the scheduler came back
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"


def test_a_dcp_checkpoint_per_rank_resumes_bit_identically_and_reads_without_a_process_group(tmp_path):
    import torch.distributed.checkpoint as dcp

    for rank, result in enumerate(gossip.simulate(N, checkpoint_resume, tmp_path, PowerGossip, True)):
        assert result["resumed_at"] == 3 and result["restored"] == {"batches": 3, "lr": 1e-2 / 4}
        assert torch.equal(result["resumed"], result["uninterrupted"]), f"rank {rank}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.dcp" for r in range(N)]
    state = read_dcp(dcp_path(tmp_path, 2))
    plain = {"training.buckets.0": torch.empty_like(state["training"]["buckets"][0])}
    dcp.load(plain, checkpoint_id=dcp_path(tmp_path, 2), no_dist=True)  # any DCP reader, no process group
    assert torch.equal(plain["training.buckets.0"], state["training"]["buckets"][0])
    assert state["rank"] == 2 and state["training"]["step"] == 3


def save_after_two_steps(comm, directory, extra=None, also_after_three=None) -> None:
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        if step == 2:
            save_checkpoint(directory, model, optimizer, extra=extra)
            if also_after_three is None:
                break
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    if also_after_three is not None:
        save_checkpoint(also_after_three, model, optimizer, extra=extra)
    model.close()


def load_into(comm, directory, module=None, schedule=None, algorithm=None, extra=None) -> str:
    model = DecentralizedDataParallel(
        module or make_mlp(comm.rank),
        comm,
        schedule or topologies.one_peer_hypercube(comm.size),
        algorithm or ExactGossip(),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        return f"resumed at {load_checkpoint(directory, model, optimizer, extra=extra)}"
    except CheckpointMismatchError as error:
        return str(error)
    finally:
        model.close()


def test_checkpoint_holds_step_optimizer_state_and_one_file_per_rank(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.pt" for r in range(N)]  # no temporary left
    state = read_checkpoint(checkpoint_path(tmp_path, 1))
    assert state["training"]["step"] == 2 and state["rank"] == 1
    assert len(state["optimizer"]["state"]) == 4  # momentum buffers of the 4 parameters
    assert set(state["rng"]) == {"torch", "numpy", "python"}
    assert gossip.simulate(N, load_into, tmp_path) == ["resumed at 2"] * N


def test_checkpoint_of_another_algorithm_config_is_refused_saying_what_differs(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    messages = gossip.simulate(N, lambda comm: load_into(comm, tmp_path, algorithm=ExactGossip(gamma=0.5)))
    assert all(
        m.startswith("rank 0: ") and "this run uses algorithm {'name': 'exact', 'gamma': 0.5}" in m for m in messages
    )
    assert all("the checkpoint uses {'name': 'exact', 'gamma': 1.0}" in m for m in messages)


def test_checkpoint_of_another_schedule_is_refused(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    messages = gossip.simulate(N, lambda comm: load_into(comm, tmp_path, schedule=topologies.ring(comm.size)))
    assert all(
        "this run uses schedule ring(n=4" in m and "the checkpoint uses one_peer_hypercube" in m for m in messages
    )


def test_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    other = lambda comm: load_into(comm, tmp_path, module=nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)))  # noqa: E731
    messages = gossip.simulate(N, other)
    assert all("parameter '0.weight' is float32[32, 8]" in m and "float32[16, 8]" in m for m in messages)


def test_checkpoint_of_another_world_size_is_refused(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    messages = gossip.simulate(2, load_into, tmp_path)
    assert all("this run has world size 2 but the checkpoint has 4" in m for m in messages)


def test_missing_rank_file_is_reported_on_every_rank(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    checkpoint_path(tmp_path, 3).unlink()
    messages = gossip.simulate(N, load_into, tmp_path)
    assert messages == [f"rank 3: no checkpoint file {checkpoint_path(tmp_path, 3)}"] * N


def test_checkpoint_of_a_smaller_world_names_both_sizes(tmp_path):
    gossip.simulate(2, save_after_two_steps, tmp_path)
    messages = gossip.simulate(N, load_into, tmp_path)
    assert all(m.startswith("rank 0: ") and "this run has world size 4 but the checkpoint has 2" in m for m in messages)


def test_a_truncated_file_is_named_with_its_rank_on_every_rank(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    path = checkpoint_path(tmp_path, 2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    messages = gossip.simulate(N, load_into, tmp_path)
    assert all(m.startswith(f"rank 2: {path} is unreadable, truncated or not a checkpoint (") for m in messages)


def test_a_corrupted_file_fails_its_checksum(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path)
    path = checkpoint_path(tmp_path, 1)
    corrupted = bytearray(path.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0x01  # one flipped bit inside the saved payload (after the 64-byte header)
    path.write_bytes(bytes(corrupted))
    messages = gossip.simulate(N, load_into, tmp_path)
    assert (
        messages == [f"rank 1: {path} fails its SHA-256 checksum: the file is corrupt; restore it from a good copy"] * N
    )


def test_files_of_different_saves_are_refused_naming_both_steps(tmp_path):
    gossip.simulate(N, save_after_two_steps, tmp_path / "a", None, tmp_path / "b")  # saves at step 2 (a) and 3 (b)
    old, new = checkpoint_path(tmp_path / "b", 3), checkpoint_path(tmp_path / "b", 0)
    checkpoint_path(tmp_path / "a", 3).replace(old)
    messages = gossip.simulate(N, load_into, tmp_path / "b")
    assert (
        messages
        == [
            f"rank 3: {old} holds step 2 but rank 0's {new} holds step 3: the files come from different saves; "
            "restore one save's files on every rank"
        ]
        * N
    )


def test_extra_state_keys_must_match(tmp_path):
    gossip.simulate(N, lambda comm: save_after_two_steps(comm, tmp_path, {"progress": {"epoch": 1}}))
    messages = gossip.simulate(N, lambda comm: load_into(comm, tmp_path, extra={"generator": torch.Generator()}))
    assert all(
        m.startswith("rank 0: ")
        and "the extra state saved has keys ['progress'] but load_checkpoint was given ['generator'] (missing "
        "['progress'], unexpected ['generator'])"
        in m
        for m in messages
    )
    given = [{} for _ in range(N)]
    assert (
        gossip.simulate(N, lambda comm: load_into(comm, tmp_path, extra={"progress": given[comm.rank]}))
        == ["resumed at 2"] * N
    )
    assert given == [{"epoch": 1}] * N


def test_a_plain_extra_value_that_is_not_a_dict_is_refused_at_save(tmp_path):
    with pytest.raises(
        TypeError, match=r"rank \d: save_checkpoint: extra\['epoch'\] \(type int\) cannot be restored in place"
    ):
        gossip.simulate(2, lambda comm: save_after_two_steps(comm, tmp_path, {"epoch": 3}))


def test_frozen_parameters_are_saved_and_restored(tmp_path):
    def save(comm) -> torch.Tensor:
        module = make_mlp(comm.rank)
        module[0].weight.requires_grad_(False)
        model = wrap(comm, module)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        save_checkpoint(tmp_path, model, optimizer)
        model.close()
        return module[0].weight.detach().clone()

    def load(comm) -> torch.Tensor:
        module = make_mlp(100 + comm.rank)  # another initialisation: the frozen weights must come from the file
        module[0].weight.requires_grad_(False)
        model = wrap(comm, module)
        load_checkpoint(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1))
        model.close()
        return module[0].weight.detach().clone()

    for saved, loaded in zip(gossip.simulate(N, save), gossip.simulate(N, load), strict=True):
        assert torch.equal(saved, loaded)


def test_a_schedule_without_period_that_diverges_stops_the_run_before_its_next_save(tmp_path):
    """Weights that differ on rank 1 from step 40 (same edges: the exchanges complete), a save at step 30 and one
    due at step 48: rank 1 and its step-40 peer name the difference at step 40 (their W(40) messages), the others
    stop at the next exchange with them, no rank reaches the second save, and the step-30 files stay as written."""

    def run(comm) -> tuple[str, bytes]:
        schedule = weights_flip_on_rank_1(comm.rank)
        model = DecentralizedDataParallel(make_mlp(comm.rank), comm, schedule, ExactGossip(), consensus_every=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        try:
            for step in range(48):
                if step == 30:
                    saved = save_checkpoint(tmp_path, model, optimizer).read_bytes()  # this rank's file, committed
                loss_of(model, *batch(comm.rank, step)).backward()
                optimizer.step()
                optimizer.zero_grad()
            save_checkpoint(tmp_path, model, optimizer)
        except GossipError as error:
            return f"{type(error).__name__}: {error}", saved
        return "no error", saved

    results = gossip.simulate(N, run, timeout=5.0)
    assert results[1][0].startswith("ReplicaMismatchError: step 40: rank 1: peer 0's schedule 'pairs' has another ")
    assert results[0][0].startswith("ReplicaMismatchError: step 40: rank 0: peer 1's schedule 'pairs' has another ")
    assert all(message.startswith("CommTimeoutError: step 41: ") for message, _ in results[2:]), results
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.pt" for r in range(N)]  # no temporary left
    for rank, (_, saved) in enumerate(results):
        assert checkpoint_path(tmp_path, rank).read_bytes() == saved, f"rank {rank}'s checkpoint was replaced"
