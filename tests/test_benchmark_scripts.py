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
    [("gpu_step.py", []), ("powergossip_compute.py", ["--device", "cuda", "--layers", "12", "--embd", "768"])],
)
def test_a_gpu_benchmark_without_cuda_says_it_is_skipped_and_returns(monkeypatch, capsys, script, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    load(script).main(argv)
    assert "skipped, no CUDA device here" in capsys.readouterr().out
