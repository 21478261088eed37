"""CapturedKernels' stages, checked on any machine with torch.cuda's graph API replaced by recording fakes.

The real capture and replay are checked on a GPU (tests/test_gpu_mpi.py: PowerGossip with and without graphs
equals the simulator bit for bit); here: eager once, captured at the second call, replayed after; a failed capture
runs the sequence now and eagerly from then on, with one warning naming the key and the cause.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gossip.algorithms.cuda_graphs import CapturedKernels
from gossip.errors import CudaGraphWarning


class FakeStream:
    def wait_stream(self, other: object) -> None:
        pass


class FakeGraph:
    replays = 0

    def replay(self) -> None:
        FakeGraph.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False, "fail": False}

    @contextlib.contextmanager
    def graph(cuda_graph, stream=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False
        if state["fail"]:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    FakeGraph.replays = 0
    return state


def test_a_sequence_runs_eagerly_once_is_captured_at_its_second_call_and_replayed_after(fake_cuda):
    captured = CapturedKernels(torch.device("cuda"), "rank 0: PowerGossip", "hint")
    calls = []
    table: dict = {}

    def sequence() -> None:
        calls.append("capturing" if fake_cuda["capturing"] else "eager")

    for _ in range(4):
        captured.run(table, "products", sequence)
    assert calls == ["eager", "capturing"]  # the third and fourth calls replay the graph without the host's calls
    assert FakeGraph.replays == 3  # once right after the capture (which ran nothing), then once per call
    assert captured.captured == 1 and captured.failed == 0
    assert isinstance(table["products"], FakeGraph)


def test_a_failed_capture_runs_the_sequence_now_and_eagerly_after_with_one_warning(fake_cuda):
    fake_cuda["fail"] = True
    captured = CapturedKernels(torch.device("cuda"), "rank 2: PowerGossip", "cuda_graphs=False silences this")
    calls = []
    table: dict = {}

    def sequence() -> None:
        calls.append("capturing" if fake_cuda["capturing"] else "eager")

    captured.run(table, ("update", 0.5), sequence)
    with pytest.warns(CudaGraphWarning, match=r"rank 2: PowerGossip: capturing its kernels \('update', 0.5\)") as w:
        captured.run(table, ("update", 0.5), sequence)
    assert "operation failed due to a previous error during capture)" in str(w[0].message)
    assert "cuda_graphs=False silences this" in str(w[0].message)
    captured.run(table, ("update", 0.5), sequence)
    # every call ran the sequence exactly once for real: eager, (capture, then eager), eager
    assert calls == ["eager", "capturing", "eager", "eager"]
    assert FakeGraph.replays == 0 and captured.captured == 0 and captured.failed == 1


def test_keys_of_one_table_are_staged_independently(fake_cuda):
    captured = CapturedKernels(torch.device("cuda"), "rank 0: PowerGossip", "hint")
    table: dict = {}
    seen = []
    for key in ("products", "products", ("difference", True)):
        captured.run(table, key, lambda key=key: seen.append((key, fake_cuda["capturing"])))
    assert seen == [("products", False), ("products", True), (("difference", True), False)]
