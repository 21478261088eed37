"""The default pipeline trains on point-to-point messages to each step's peers only (W(t)'s, and W(kt)'s, ...,
W(kt + k - 1)'s for the trackers' k hops at n = 12): from the first step to close() no all-reduce, all-gather,
broadcast or barrier is issued, on the simulator, Gloo and MPI (issue 59), with its second moment sampled and
gossiped every 64 steps (the default) or read off the trackers; the sampled run with the mean gradient all-reduced
is the control that shows the recorder sees collectives."""

from __future__ import annotations

import pytest
from helpers.collective_scenarios import STEPS, default_pipeline_run
from helpers.launch import results_on_backend

import gossip


def _assert_pure_gossip(results: list[dict], n: int, samples: int) -> None:
    for rank, result in enumerate(results):
        assert result["collectives"] == [], f"rank {rank}: {result['collectives'][:5]}"
        assert result["stray"] == [], f"rank {rank} sent to a rank that is not a peer of that step: {result['stray']}"
        # the trackers' second hop meets peers W(t) does not name; with one hop every peer is W(t)'s
        assert (result["hop_peers"] > 0) == (result["tracker_hops"] > 1), f"rank {rank}: {result['hop_peers']}"
        # the recorder saw every step's exchange, and step STEPS', posted after the last update (close() drains it)
        assert result["steps_with_exchanges"] == STEPS + 1, f"rank {rank}"
        assert result["samples"] == samples, f"rank {rank}"  # sampled: those of steps 0 and 64 arrived
        assert result["last_loss"] < result["first_loss"]


@pytest.mark.parametrize(("second_moment", "samples"), [("tracker", 0), ("sample", 2)])
@pytest.mark.parametrize("n", [4, 6, 12])
def test_the_default_pipeline_issues_no_collective_on_the_simulator(n, second_moment, samples):
    results = gossip.simulate(n, default_pipeline_run, "gossip", second_moment)
    assert results[0]["schedule"] == ("one_peer_hypercube" if n == 4 else "base_graph")
    assert results[0]["tracker_hops"] == gossip.default_tracker_hops(n)
    _assert_pure_gossip(results, n, samples)


def test_the_recorder_sees_the_all_reduce_of_an_all_reduced_mean_gradient():
    """The control: mean_gradient='allreduce' all-reduces the gradients at the steps the sample is due."""
    for result in gossip.simulate(4, default_pipeline_run, "allreduce", "sample"):
        assert result["collectives"] == [(0, "all_reduce"), (64, "all_reduce")]
        assert result["stray"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_default_pipeline_issues_no_collective_on_real_backends(backend, tmp_path_factory):
    _, results = results_on_backend("collective_worker.py", backend, tmp_path_factory, n=4)
    _assert_pure_gossip([r["gossip"] for r in results], 4, samples=2)
    _assert_pure_gossip([r["tracker"] for r in results], 4, samples=0)
