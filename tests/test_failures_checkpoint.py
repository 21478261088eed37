"""Checkpoint failures: a crash, a full disk, a refused permission or a kill in the middle of writing a checkpoint
leaves the previous one intact and no partial file, and every rank raises a named error; a file that would run
code when loaded is refused; asynchronous saves report their failures."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import random
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.parallel_scenarios import batch, flat_parameters, loss_of, make_mlp, wrap
from torch import nn

import gossip
import gossip.checkpoint
import gossip.checkpoint.file_format
from gossip.checkpoint import (
    CheckpointMismatchError,
    atomic_save,
    checkpoint_path,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    temporaries,
)
from gossip.errors import CheckpointWriteError, UntrustedCheckpointError


class Crash(Exception):
    pass


def test_crash_mid_save_keeps_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = tmp_path / "rank0.pt"
    atomic_save({"step": 1, "x": torch.arange(1000.0)}, path)
    real_save = torch.save

    def save_half_then_crash(obj, file) -> None:
        real_save(obj, file)
        file.truncate(file.tell() // 2)  # part of the new checkpoint is on disk when the crash comes
        raise Crash

    monkeypatch.setattr(gossip.checkpoint.file_format.torch, "save", save_half_then_crash)
    with pytest.raises(Crash):
        atomic_save({"step": 2, "x": torch.zeros(1000)}, path)
    assert torch.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt"]  # the temporary file is gone


# -- issue 31: a failed save never loses the previous checkpoint; named errors on every rank ----------------------

N = 4


def train_and_save(comm, directory, steps: int, extra=None, **options):
    """Train ``steps`` steps, then save (sync unless ``async_save``); return (result of save or error, model...)."""
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        loss_of(model, *batch(comm.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    try:
        return save_checkpoint(directory, model, optimizer, extra=extra, **options)
    except Exception as error:
        return error
    finally:
        if not options.get("async_save"):
            model.close()


def load_into(comm, directory, trusted: bool = False, extra=None):
    model = wrap(comm, make_mlp(100 + comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        return load_checkpoint(directory, model, optimizer, trusted=trusted, extra=extra), flat_parameters(model)
    except Exception as error:
        return error, None
    finally:
        model.close()


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def fail_writes_of(thread_name: str, monkeypatch, code: int = errno.ENOSPC, after: int = 512) -> None:
    """Make the checkpoint writer of one thread (a simulated rank) fail with ``OSError(code)`` after ``after``
    bytes, as a full disk does in the middle of a file."""
    real_write = gossip.checkpoint.file_format._HashingWriter._write_through

    def write(self, data) -> int:
        if threading.current_thread().name == thread_name and self.size + len(data) > after:
            raise OSError(code, os.strerror(code))
        return real_write(self, data)

    monkeypatch.setattr(gossip.checkpoint.file_format._HashingWriter, "_write_through", write)


@pytest.mark.parametrize(
    ("code", "kind", "advice"),
    [
        (errno.ENOSPC, "OSError", "is full"),
        (errno.EDQUOT, "OSError", "over quota"),
        (errno.EACCES, "PermissionError", "may not write"),
    ],
)
def test_a_failed_write_on_one_rank_keeps_every_previous_checkpoint_and_every_rank_names_it(
    tmp_path, monkeypatch, code, kind, advice
):
    gossip.simulate(N, train_and_save, tmp_path, 2)
    before = file_bytes(tmp_path)
    fail_writes_of("sim-rank-1", monkeypatch, code)
    errors = gossip.simulate(N, train_and_save, tmp_path, 3)
    path = checkpoint_path(tmp_path, 1)
    expected = (
        f"rank 1: save_checkpoint at step 3 could not write {path} ({kind}: [Errno {code}] {os.strerror(code)}); "
    )
    for error in errors:
        assert isinstance(error, CheckpointWriteError) and isinstance(error, gossip.GossipError)
        assert str(error).startswith(expected), str(error)
        assert advice in str(error) and str(error).endswith(
            "its previous checkpoint is unchanged; no rank replaced its previous checkpoint"
        )
    assert len({str(e) for e in errors}) == 1  # the same message on every rank
    assert file_bytes(tmp_path) == before  # every previous file bit-identical, no temporary file left
    monkeypatch.undo()
    assert [step for step, _ in gossip.simulate(N, load_into, tmp_path)] == [2] * N


def test_a_failed_save_with_no_previous_checkpoint_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    fail_writes_of("sim-rank-2", monkeypatch)
    errors = gossip.simulate(N, train_and_save, tmp_path, 1)
    assert all(isinstance(e, CheckpointWriteError) and "rank 2: " in str(e) for e in errors)
    assert "it had no previous checkpoint" in str(errors[0])
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_files_of_a_killed_save_are_removed_by_the_next_save(tmp_path):
    gossip.simulate(2, train_and_save, tmp_path, 1)
    stale = [tmp_path / ".rank0.pt.abc123.tmp", tmp_path / ".rank1.pt.xyz789.tmp"]
    for path in stale:
        path.write_bytes(b"part of a checkpoint")
    other = tmp_path / "notes.tmp"  # not a checkpoint's temporary file: left alone
    other.write_text("keep")
    gossip.simulate(2, train_and_save, tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "rank0.pt", "rank1.pt"]


def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint_and_the_next_load_cleans_up(tmp_path):
    worker = Path(__file__).parent / "helpers" / "checkpoint_kill_worker.py"
    process = subprocess.run([sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert process.returncode == -signal.SIGKILL, process.stdout + process.stderr
    directory = tmp_path / "ckpt"
    before = (tmp_path / "before.txt").read_text().split()
    assert [hashlib.sha256(checkpoint_path(directory, r).read_bytes()).hexdigest() for r in (0, 1)] == before
    assert temporaries(checkpoint_path(directory, 1))  # the killed write left its temporary file behind
    assert [step for step, _ in gossip.simulate(2, load_into, directory)] == [2, 2]
    assert sorted(p.name for p in directory.iterdir()) == ["rank0.pt", "rank1.pt"]  # the load removed it


def mount_tmpfs(mount_point: Path, size: int) -> None:
    """Mount a tmpfs of ``size`` bytes; skip the test where this process may not mount (not root, no
    CAP_SYS_ADMIN): the injected-OSError tests above cover the same code paths."""
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")


def save_a_small_model(comm, directory, steps):
    model = wrap(comm, nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x = torch.randn(8, 48, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    try:
        return save_checkpoint(directory, model, optimizer)
    except Exception as error:
        return error
    finally:
        model.close()


def test_a_real_full_disk_fails_the_save_by_name_and_keeps_the_previous_checkpoint(tmp_path):
    gossip.simulate(2, save_a_small_model, tmp_path / "measure", 1)
    pages = -(-checkpoint_path(tmp_path / "measure", 0).stat().st_size // 4096)
    tiny = tmp_path / "tiny"  # room for one checkpoint (2 files) and one page: not for a second one beside it
    mount_tmpfs(tiny, (2 * pages + 1) * 4096)
    try:
        first = gossip.simulate(2, save_a_small_model, tiny, 1)
        assert all(isinstance(p, Path) for p in first), first
        before = file_bytes(tiny)
        errors = gossip.simulate(2, save_a_small_model, tiny, 2)
        assert all(isinstance(e, CheckpointWriteError) for e in errors), errors
        assert "(OSError: [Errno 28] No space left on device); the file system of" in str(errors[0])
        assert len({str(e) for e in errors}) == 1
        assert file_bytes(tiny) == before  # the previous checkpoint bit-identical, no temporary file left
        assert [step for step, _ in gossip.simulate(2, load_small_model, tiny)] == [1, 1]
    finally:
        subprocess.run(["umount", "-l", str(tiny)], check=False)


def load_small_model(comm, directory):
    model = wrap(comm, nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        return load_checkpoint(directory, model, optimizer), None
    finally:
        model.close()


# -- streaming and asynchronous saves -------------------------------------------------------------------------------


def test_the_serialised_state_is_never_held_in_memory(tmp_path):
    """The state is streamed to the file: Python never holds its serialised bytes (an ``io.BytesIO`` of the
    whole state would show in tracemalloc as about the size of the file)."""

    def save(comm) -> int | None:
        model = wrap(comm, nn.Sequential(nn.Linear(512, 512)))  # 1 MiB of parameters, 1 MiB of momentum
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 512)).sum().backward()
        optimizer.step()
        comm.barrier()
        if comm.rank == 0:
            tracemalloc.start()  # process-wide: traces both ranks' saves
        comm.barrier()
        save_checkpoint(tmp_path, model, optimizer)
        comm.barrier()
        peak = tracemalloc.get_traced_memory()[1] if comm.rank == 0 else None
        comm.barrier()
        if comm.rank == 0:
            tracemalloc.stop()
        model.close()
        return peak

    peak = gossip.simulate(2, save)[0]
    size = checkpoint_path(tmp_path, 0).stat().st_size
    assert size > 2_000_000
    assert peak < size / 10, f"Python allocated {peak} bytes while saving a {size}-byte checkpoint"


def test_an_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path):
    def run(comm):
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = flat_parameters(model)
        future = save_checkpoint(tmp_path / "async", model, optimizer, async_save=True)
        for step in range(2, 4):  # training goes on and changes the parameters and the momentum in place
            loss_of(model, *batch(comm.rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        path = future.wait()
        assert future.done() and future.wait() == path  # a second wait returns at once, no collective
        model.close()
        return saved

    saved = gossip.simulate(N, run)
    gossip.simulate(N, train_and_save, tmp_path / "sync", 2)
    for rank in range(N):  # the async file holds exactly the state of step 2, as a synchronous save does
        async_state = read_checkpoint(checkpoint_path(tmp_path / "async", rank))
        sync_state = read_checkpoint(checkpoint_path(tmp_path / "sync", rank))
        assert async_state["training"]["step"] == 2
        for a, b in zip(async_state["training"]["buckets"], sync_state["training"]["buckets"], strict=True):
            assert torch.equal(a, b)
        momentum = [s["momentum_buffer"] for s in async_state["optimizer"]["state"].values()]
        expected = [s["momentum_buffer"] for s in sync_state["optimizer"]["state"].values()]
        assert all(torch.equal(a, b) for a, b in zip(momentum, expected, strict=True))
    for (step, parameters), before in zip(gossip.simulate(N, load_into, tmp_path / "async"), saved, strict=True):
        assert step == 2 and torch.equal(parameters, before)


def test_a_failed_async_write_is_raised_on_every_rank_at_the_next_save(tmp_path, monkeypatch):
    """Rank 1's background write fails: at the next save every rank raises the same error, and no rank replaced
    its previous checkpoint (the asynchronous save commits in two phases too)."""
    gossip.simulate(N, train_and_save, tmp_path, 1)
    previous = {rank: checkpoint_path(tmp_path, rank).read_bytes() for rank in range(N)}
    fail_writes_of("checkpoint-rank1", monkeypatch)  # the background writer thread of rank 1

    def run(comm):
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        future = save_checkpoint(tmp_path, model, optimizer, async_save=True)
        while not future.done():  # every rank's background write has ended (rank 1's failed) before the next save
            time.sleep(0.01)
        loss_of(model, *batch(comm.rank, 0)).backward()
        optimizer.step()
        try:
            save_checkpoint(tmp_path, model, optimizer)  # waits for the pending save first: its error is not lost
            return None
        except CheckpointWriteError as error:
            return str(error)
        finally:
            model.close()

    messages = gossip.simulate(N, run)
    path = checkpoint_path(tmp_path, 1)
    assert all(
        m is not None
        and m.startswith(f"rank 1: save_checkpoint at step 0 could not write {path}")
        and m.endswith("no rank replaced its previous checkpoint")
        for m in messages
    )
    for rank in range(N):
        assert checkpoint_path(tmp_path, rank).read_bytes() == previous[rank]
        assert not temporaries(checkpoint_path(tmp_path, rank))


# -- safe loading ---------------------------------------------------------------------------------------------------

RAN: list[str] = []


def _payload_ran(tag: str) -> str:
    RAN.append(tag)
    return tag


class RunsCode:
    """Unpickling this calls a function: what a malicious checkpoint does."""

    def __reduce__(self):
        return (_payload_ran, ("pickled code ran",))


class Opaque:
    def __init__(self) -> None:
        self.value = 3

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


class HoldsAnObject:
    """An ``extra`` value whose state is not plain data."""

    def __init__(self) -> None:
        self.thing = Opaque()

    def state_dict(self) -> dict:
        return {"thing": self.thing}

    def load_state_dict(self, state: dict) -> None:
        self.thing = state["thing"]


def test_a_checkpoint_that_would_run_code_is_refused_by_name_on_every_rank(tmp_path):
    gossip.simulate(2, train_and_save, tmp_path, 2)
    path = checkpoint_path(tmp_path, 1)
    state = read_checkpoint(path)
    state["evil"] = RunsCode()
    payload = io.BytesIO()
    torch.save(state, payload)
    data = payload.getvalue()  # a well-formed file with a valid checksum: only its content is hostile
    header = gossip.checkpoint.HEADER.pack(
        b"GOSSIPCK", gossip.checkpoint.FORMAT_VERSION, len(data), hashlib.sha256(data).digest()
    )
    path.write_bytes(header + data)
    RAN.clear()
    results = gossip.simulate(2, load_into, tmp_path)
    assert RAN == []  # nothing in the file ran
    for error, _ in results:
        assert isinstance(error, UntrustedCheckpointError), error
        assert str(error).startswith(f"rank 1: {path} holds objects that a weights-only load refuses (")
        assert "_payload_ran" in str(error) and "pass trusted=True to load_checkpoint only if you wrote" in str(error)


def test_extra_state_that_needs_pickling_is_an_explicit_opt_in_at_save_and_at_load(tmp_path):
    errors = gossip.simulate(2, train_and_save, tmp_path, 1, {"custom": HoldsAnObject()})
    for error in errors:
        assert isinstance(error, UntrustedCheckpointError), error
        assert str(error).startswith(
            "rank 0: save_checkpoint: the checkpoint['extra']['custom']['state']['thing'] is a "
            "test_failures_checkpoint.Opaque, which a weights-only load refuses"
        )
        assert "pass trusted=True to save_checkpoint and to load_checkpoint" in str(error)
    assert list(tmp_path.iterdir()) == []
    assert all(
        isinstance(p, Path)
        for p in gossip.simulate(2, train_and_save, tmp_path, 1, {"custom": HoldsAnObject()}, trusted=True)
    )
    refused = gossip.simulate(2, load_into, tmp_path, False, {"custom": HoldsAnObject()})
    assert all(isinstance(e, UntrustedCheckpointError) and "trusted=True" in str(e) for e, _ in refused)
    targets = [HoldsAnObject() for _ in range(2)]
    for target in targets:
        target.thing = None
    loaded = gossip.simulate(2, lambda comm: load_into(comm, tmp_path, True, {"custom": targets[comm.rank]}))
    assert [step for step, _ in loaded] == [1, 1] and all(t.thing == Opaque() for t in targets)


def test_the_rng_streams_round_trip_through_a_weights_only_load(tmp_path):
    """The RNGs are process-wide (the simulated ranks share them): rank 0 draws once every rank saved or loaded."""

    def run(comm, load: bool):
        model = wrap(comm, make_mlp(comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        comm.barrier()
        (load_checkpoint if load else save_checkpoint)(tmp_path, model, optimizer)
        comm.barrier()
        drawn = (torch.rand(3), np.random.rand(3), random.random()) if comm.rank == 0 else None
        model.close()
        return drawn

    expected = gossip.simulate(2, run, False)[0]
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    got = gossip.simulate(2, run, True)[0]
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_a_checkpoint_of_the_previous_format_is_refused_unless_trusted(tmp_path):
    path = checkpoint_path(tmp_path, 0)
    data = io.BytesIO()
    torch.save({"rank": 0}, data)
    atomic_save({"format": 2, "sha256": hashlib.sha256(data.getvalue()).hexdigest(), "state": data.getvalue()}, path)
    with pytest.raises(UntrustedCheckpointError, match=r"has format 2 .* load it once with trusted=True"):
        read_checkpoint(path)
    assert read_checkpoint(path, trusted=True) == {"rank": 0}


def test_checkpoint_errors_are_gossip_errors():
    assert issubclass(CheckpointMismatchError, gossip.GossipError) and issubclass(CheckpointMismatchError, ValueError)
    assert issubclass(CheckpointWriteError, gossip.CheckpointError)
    assert issubclass(UntrustedCheckpointError, gossip.CheckpointError)
