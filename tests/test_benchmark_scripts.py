"""The GPU benchmarks on a machine without CUDA: they say so and return, instead of failing in torch's CUDA
initialisation (the tier's tests skip the same way, tests/test_gpu_tier.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(script: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmark_{Path(script).stem}", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("gpu_step.py", []),
        ("gpu_profile.py", []),
        ("powergossip_compute.py", ["--device", "cuda", "--layers", "12", "--embd", "768"]),
    ],
)
def test_a_gpu_benchmark_without_cuda_says_it_is_skipped_and_returns(monkeypatch, capsys, script, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    load(script).main(argv)
    assert "skipped, no CUDA device here" in capsys.readouterr().out


def test_the_gpu_busy_time_is_the_union_of_the_kernels_intervals(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    busy = load("gpu_profile.py").busy_microseconds
    assert busy([]) == 0
    assert busy([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20  # overlaps counted once, gaps not at all
    assert busy([(20, 25), (0, 10)]) == 15


def test_the_profile_runs_on_the_cpu_and_names_the_host_operations(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    small = ["--layers", "1", "--embd", "32", "--heads", "2", "--block", "16", "--vocab", "64", "--batch", "2"]
    load("gpu_profile.py").main(["--device", "cpu", "--rounds", "2", "--warmup", "1", *small])
    out = capsys.readouterr().out
    assert "rank 4, op by op: wall" in out and "aten::" in out
    assert "CUDA graph capture failed: RuntimeError: CUDA graphs need a CUDA device" in out
