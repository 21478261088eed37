"""A crash in the middle of writing a checkpoint leaves the previous checkpoint intact and no partial file."""

from __future__ import annotations

import pytest
import torch

import gossip.checkpoint
from gossip.checkpoint import atomic_save


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

    monkeypatch.setattr(gossip.checkpoint.torch, "save", save_half_then_crash)
    with pytest.raises(Crash):
        atomic_save({"step": 2, "x": torch.zeros(1000)}, path)
    assert torch.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt"]  # the temporary file is gone
