"""The step-time split of finished time-to-loss runs (experiments/time_to_loss/phases.py), on synthetic runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from experiments.time_to_loss.phases import arrival_spreads, main, phases, split
from experiments.time_to_loss.study import BenchmarkError


def _row(step: int, sent: int, step_s: float, compute_s: float, wait_s: float, elapsed_s: float = 0.0) -> dict:
    return {
        "step": step,
        "elapsed_seconds": elapsed_s,
        "bytes_sent": sent,
        "step_seconds": step_s,
        "compute_seconds": compute_s,
        "finish_seconds": wait_s + 0.001,
        "wait_seconds": wait_s,
    }


def _run(root: Path, name: str, ranks: list[list[dict]]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("step\n")
    for rank, rows in enumerate(ranks):
        (run / f"metrics_rank{rank}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


def _hybrid_rank(offset: float) -> list[dict]:
    """12 steps: the set-up steps 0-1 (huge, must be left out), then every 5th an all-reduce of the model; every
    step ``offset`` s slower than on a rank with offset 0."""
    rows = [_row(0, 50, 9.0, 9.0, 9.0, 9.0), _row(1, 50, 9.0, 9.0, 9.0, 18.0)]
    for step in range(2, 12):
        sync = step % 5 == 4
        seconds = (0.3 if sync else 0.1) + offset
        rows.append(
            _row(
                step, 3000 if sync else 50, seconds, 0.05, 0.2 if sync else 0.01, rows[-1]["elapsed_seconds"] + seconds
            )
        )
    return rows


def test_steps_sending_more_than_the_median_are_synchronisation_steps():
    kinds = split([_hybrid_rank(0.0)[2:], _hybrid_rank(0.0)[2:]])
    assert sorted({row["step"] for row in kinds["sync"]}) == [4, 9]
    assert len(kinds["sync"]) == 4 and len(kinds["gossip"]) == 16


def test_a_run_sending_the_same_bytes_every_step_has_only_gossip_steps():
    kinds = split([[_row(step, 50, 0.1, 0.05, 0.01) for step in range(2, 8)]])
    assert kinds["sync"] == [] and len(kinds["gossip"]) == 6


def test_phases_average_every_rank_and_seed_after_the_set_up_steps(tmp_path):
    _run(tmp_path, "20261126-100000-100mbit-r0-s0-pg4-it2-fp16-h10-avg-adamw", [_hybrid_rank(0.0), _hybrid_rank(0.02)])
    _run(tmp_path, "20261126-100000-100mbit-r0-s1-pg4-it2-fp16-h10-avg-adamw", [_hybrid_rank(0.04), _hybrid_rank(0.06)])
    table = {row["kind"]: row for row in phases(tmp_path)}
    assert table["sync"]["seeds"] == "0 1" and table["sync"]["samples"] == 8
    assert table["sync"]["step_ms"] == pytest.approx(330.0)  # 300 ms plus the ranks' mean offset of 30 ms
    assert table["gossip"]["step_ms"] == pytest.approx(130.0)
    assert table["gossip"]["wait_ms"] == pytest.approx(10.0) and table["sync"]["wait_ms"] == pytest.approx(200.0)
    assert table["gossip"]["finish_ms"] == pytest.approx(11.0) and table["gossip"]["compute_ms"] == pytest.approx(50.0)
    # from the end of step 4 to the end of step 8 the ranks of a run 0.02 s a step apart drift 4 x 0.02 s apart
    assert table["sync"]["arrival_spread_ms"] == pytest.approx(80.0) and table["gossip"]["arrival_spread_ms"] == ""


def test_the_arrival_spread_needs_two_synchronisation_steps_with_steps_between():
    few = [_hybrid_rank(0.0)[2:8], _hybrid_rank(0.5)[2:8]]
    assert arrival_spreads(few, split(few)["sync"]) == []  # one synchronisation step: 4
    ranks = [_hybrid_rank(0.0), _hybrid_rank(0.5)]
    spreads = arrival_spreads(ranks, split(ranks)["sync"])
    assert spreads == [pytest.approx(2.0)]  # steps 5-8 on the slower rank: 4 x 0.5 s later


def test_the_command_line_writes_the_table_as_csv(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "20261126-100000-1gbit-r0-s0-pg4-it2-fp16-h10-avg-adamw", [_hybrid_rank(0.0)])
    assert main([str(runs), "--results", str(tmp_path / "out"), "--csv", "phases.csv"]) == 0
    rows = list(csv.DictReader((tmp_path / "out" / "phases.csv").read_text().splitlines()))
    assert [(row["runs"], row["rate"], row["kind"]) for row in rows] == [
        ("runs", "1gbit", "gossip"),
        ("runs", "1gbit", "sync"),
    ]


def test_a_run_without_per_rank_metrics_is_skipped_and_no_runs_at_all_is_an_error(tmp_path):
    _run(tmp_path, "20261126-100000-100mbit-r0-s0-ddp", [])  # decent-dp's runner: metrics.csv only
    assert phases(tmp_path) == []
    with pytest.raises(BenchmarkError, match="no gossip-train runs"):
        main([str(tmp_path)])


def test_per_rank_metrics_without_the_timings_are_named(tmp_path):
    run = _run(tmp_path, "20261126-100000-100mbit-r0-s0-ddp", [[{"step": 2, "bytes_sent": 1}]])
    with pytest.raises(BenchmarkError, match=r"metrics_rank0.jsonl: no step_seconds, .*elapsed_seconds"):
        phases(run.parent)
