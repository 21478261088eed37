"""The benchmarks' own arithmetic, and the GPU benchmarks on a machine without CUDA: they say so and return, instead
of failing in torch's CUDA initialisation (the tier's tests skip the same way, tests/test_gpu_tier.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

import topologies
from gossip.algorithms.period import Period

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


def test_peer_lateness_is_how_long_after_the_rank_its_latest_peer_of_the_step_ended_backward(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    lateness = load("overlap.py").peer_lateness
    # 4 ranks, one-peer hypercube: rank 0's peer is rank 1 at steps 0 and 2, rank 2 at step 1; step 3 ends a period
    ready = [[10.0, 20.0, 30.0, 40.0], [10.5, 19.0, 30.25, 40.0], [9.0, 21.0, 35.0, 40.5], [12.0, 20.0, 30.0, 43.0]]
    rows = [{"step": step} for step in range(4)]
    comm = SimpleNamespace(rank=0, size=4, all_gather_object=lambda own: [own, *ready[1:]])
    late = lateness(comm, topologies.one_peer_hypercube(4), Period(4), rows, ready[0])
    # step 0: rank 1 half a second later; step 1: rank 2 one later (rank 3, later still, is not its peer);
    # step 2: rank 1 a quarter later (rank 2 is not its peer); step 3 averages: rank 3, the latest of all, 3 later
    assert late == [0.5, 1.0, 0.25, 3.0]
    comm = SimpleNamespace(rank=3, size=4, all_gather_object=lambda own: [*ready[:3], own])
    assert lateness(comm, topologies.one_peer_hypercube(4), None, rows, ready[3]) == [0.0, 0.0, 5.0, 0.0]


@pytest.mark.parametrize(
    ("name", "algorithm", "trackers", "every"),
    [
        ("mt-exact", "ExactGossip", None, 32),
        ("mt-pg", "PowerGossip", None, 32),
        ("mt-sign", "PowerGossip", "ChocoSign", 64),
    ],
)
def test_the_overlap_benchmarks_momentum_tracking_is_the_main_jobs(monkeypatch, name, algorithm, trackers, every):
    """The rows time what `gossip-train --gradient-tracking {exact,sign} --optimizer momentum-tracking-adamw`
    trains with."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import optim

    method = load("overlap.py").algorithms(4)[name]
    assert type(method.make_algorithm()).__name__ == algorithm
    if trackers is None:
        assert method.gradient_tracking is True  # exact trackers
    else:
        assert type(method.gradient_tracking).__name__ == trackers
    optimizer = method.make_optimizer(torch.nn.Linear(3, 2))
    assert isinstance(optimizer, optim.MomentumTrackingAdamW) and optimizer.second_moment_every == every


def test_the_overlap_benchmarks_defaults_are_the_pipeline_and_the_previous_hybrid(monkeypatch):
    """`default` times what `gossip.wrap` builds; `previous-defaults` what `gossip-train --outer-every 10` trains
    with: the main job's PowerGossip and an outer step over an all-reduce every 10 steps."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gossip

    methods = load("overlap.py").algorithms(4)
    assert methods["default"].pipeline == gossip.Pipeline()
    previous = methods["previous-defaults"].make_algorithm()
    assert isinstance(previous, gossip.OuterOptimizer) and previous.local_steps == 10
    assert isinstance(previous.averaging, gossip.AllReduce)
    between = previous.between
    assert isinstance(between, gossip.PowerGossip)
    assert (between.matrix_rank, between.num_iterations, between.message_dtype) == (4, 2, torch.float16)


def test_the_overlap_benchmark_refuses_a_method_it_does_not_measure_and_the_device_check_names_known_ones(
    monkeypatch,
):
    """An unknown name in ``--methods`` is an error naming it, not a row silently left out; every ``--methods`` of
    the prepared device call (benchmarks/device_check.sh) is one the benchmark measures."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    names = load("overlap.py").method_names
    assert names("default,ddp") == ["default", "ddp"]
    with pytest.raises(ValueError, match="unknown main-job-defaults;"):
        names("default,main-job-defaults")
    script = (BENCHMARKS / "device_check.sh").read_text()
    lists = re.findall(r"--methods (\S+)", script)
    assert lists and all(names(methods) for methods in lists)


def test_the_sign_codec_benchmark_compares_its_results_with_the_baselines_bit_for_bit(monkeypatch, capsys, tmp_path):
    """A line per level with both times; the results' check passes against the current module as the baseline and
    fails against one whose scales differ."""
    from gossip.algorithms import scaled_sign

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = load("sign_codec.py")
    rows = benchmark.main(["--numel", "1003", "--repeats", "2", "--baseline-file", scaled_sign.__file__])
    assert [row["levels"] for row in rows] == [1, 2, 4] and all(row["identical"] for row in rows), rows
    assert all(row["baseline_ms"] > 0 and row["current_ms"] > 0 for row in rows)
    assert all(row["baseline_cpu_ms"] >= 0 and row["current_cpu_ms"] >= 0 for row in rows)
    assert capsys.readouterr().out.count("bit-identical") == 3
    skewed = tmp_path / "skewed_codec.py"
    skewed.write_text(
        "from gossip.algorithms.scaled_sign import pack_signs as exact, unpack_signs\n\n\n"
        "def pack_signs(residual, chunk, levels=1):\n"
        "    signs, scales, *splits = exact(residual, chunk, levels)\n"
        "    return (signs, 2 * scales, *splits)\n"
    )
    rows = benchmark.main(["--numel", "1003", "--repeats", "2", "--levels", "2", "--baseline-file", str(skewed)])
    assert not rows[0]["identical"] and "DIFFERENT RESULTS" in capsys.readouterr().out
