"""Per-step metrics of DecentralizedDataParallel (gossip.wrapper.metrics), on the simulator."""

from __future__ import annotations

import json
import math

import torch
from helpers.parallel_scenarios import batch, loss_of, make_mlp, wrap

import gossip

N = 4
STEPS = 6


def run(comm, run_dir, consensus_every: int) -> dict:
    model = wrap(comm, make_mlp(comm.rank), run_dir=run_dir, consensus_every=consensus_every, consensus_samples=10**6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        loss = loss_of(model, *batch(comm.rank, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.log(loss=loss)
    exact = model.consensus_distance()
    numel = sum(p.numel() for p in model.parameters())
    return {"summary": model.close(), "exact": exact, "numel": numel}


def rows(run_dir, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"metrics_rank{rank}.jsonl").read_text().splitlines()]


def test_one_row_per_step_with_loss_lr_bytes_and_times(tmp_path):
    results = gossip.simulate(N, run, tmp_path, 0)
    for rank in range(N):
        lines = rows(tmp_path, rank)
        assert [row["step"] for row in lines] == list(range(STEPS))
        for row in lines:
            assert row["lr"] == 0.05 and math.isfinite(row["loss"])
            assert row["bytes_sent"] == row["bytes_received"] == 4 * results[rank]["numel"]  # one peer, float32
            assert 0 <= row["wait_seconds"] <= row["finish_seconds"]
            assert row["compute_seconds"] > 0 and row["step_seconds"] >= row["compute_seconds"]
            assert "consensus" not in row


def test_sampled_consensus_every_k_steps_equals_the_exact_value_when_sampling_everything(tmp_path):
    results = gossip.simulate(N, run, tmp_path, 3)
    lines = rows(tmp_path, 0)
    assert [row["step"] for row in lines if "consensus" in row] == [2, 5]
    assert math.isclose(lines[-1]["consensus"], results[0]["exact"], rel_tol=1e-9)


def test_summary_only_on_rank_0_with_total_bytes(tmp_path):
    results = gossip.simulate(N, run, tmp_path, 0)
    assert all(result["summary"] is None for result in results[1:])
    summary = results[0]["summary"]
    assert summary["steps"] == STEPS and summary["ranks"] == N
    assert summary["total_bytes_sent"] == N * STEPS * 4 * results[0]["numel"]
    assert 0 <= summary["exposed_fraction"] <= 1
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
