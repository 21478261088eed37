"""The cluster-scale time-to-loss prediction (experiments.runtime_model.cluster): its arithmetic, by properties."""

import dataclasses
import math

import numpy as np
import pytest

import gossip
from experiments.runtime_model.cluster import (
    GPT2_SMALL,
    METHODS,
    Workload,
    allreduce_s,
    ddp_step,
    default_step,
    diloco_step,
    gpt2_shapes,
    main,
    time_ratio,
)
from experiments.runtime_model.costs import RuntimeModelError
from experiments.scale.sign import message_bytes

GBIT = 1e9 / 8


@pytest.fixture(scope="module")
def work() -> Workload:
    return Workload(tuple(gpt2_shapes(*GPT2_SMALL)), compute_s=0.1)


def test_gpt2_small_has_its_124m_parameters(work):
    assert work.params == 124_439_808 and work.model_bytes == 4 * work.params


@pytest.mark.parametrize("n", [64, 256, 1024])
def test_ddps_all_reduce_is_the_ring_formula(work, n):
    ring = Workload(work.shapes, work.compute_s, allreduce="ring")
    expected = 2 * (n - 1) / n * work.model_bytes / (10 * GBIT)
    assert allreduce_s(ring, n, 10 * GBIT, 0.0) == pytest.approx(expected, rel=1e-12)
    assert allreduce_s(work, n, 10 * GBIT, 0.0) == pytest.approx(expected, rel=1e-12)  # same bytes, fewer alphas
    assert allreduce_s(ring, n, 10 * GBIT, 1e-5) == pytest.approx(expected + 2 * (n - 1) * 1e-5, rel=1e-12)
    # DDP hides the all-reduce behind a third of the compute only
    assert ddp_step(ring, n, 10 * GBIT, 0.0) == pytest.approx(max(0.1, expected + 0.1 - 0.1 / 3), rel=1e-12)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("n", [64, 1024])
def test_step_time_is_monotone_in_bandwidth_and_at_least_the_compute(work, method, n):
    times = [METHODS[method](work, n, b, 1e-5) for b in np.geomspace(0.1 * GBIT, 1e4 * GBIT, 15)]
    assert np.all(np.diff(times) <= 1e-15) and min(times) >= work.compute_s


def test_the_defaults_parts_and_its_limit_on_an_infinitely_fast_network(work):
    n, bandwidth = 256, 10 * GBIT
    trackers = sum(message_bytes(math.prod(s), 256, 4) for s in work.shapes)
    assert work.sign_bytes() == trackers
    hops = work.hops(n)
    assert work.tracker_hops is None and hops == gossip.default_tracker_hops(n) == 5
    # fast network: only the trackers' k messages after the backward show, everything else hides
    assert default_step(work, n, 1e6 * GBIT, 0.0) == pytest.approx(work.compute_s + hops * trackers / (1e6 * GBIT))
    # slow: 8 of 64 steps carry a model-sized hop on top of the factors, the trackers' k messages on every step
    base = 2 * 1e-5 + work.powergossip_bytes(n) / bandwidth
    hop = base + work.model_bytes / bandwidth
    expected = (8 * max(0.1, hop) + 56 * max(0.1, base)) / 64 + hops * (1e-5 + trackers / bandwidth)
    assert default_step(work, n, bandwidth, 1e-5) == pytest.approx(expected, rel=1e-12)
    # one hop: k - 1 messages less, exactly
    one = dataclasses.replace(work, tracker_hops=1)
    assert one.hops(n) == 1
    fewer = (hops - 1) * (1e-5 + trackers / bandwidth)
    assert default_step(one, n, bandwidth, 1e-5) == pytest.approx(expected - fewer, rel=1e-12)
    with pytest.raises(RuntimeModelError, match="tracker_hops must be >= 1"):
        default_step(dataclasses.replace(work, tracker_hops=0), n, bandwidth, 1e-5)


def test_diloco_pays_one_all_reduce_every_h_steps(work):
    for every in (1, 10, 100):
        h = Workload(work.shapes, work.compute_s, diloco_every=every)
        assert diloco_step(h, 64, GBIT, 1e-5) == pytest.approx(0.1 + allreduce_s(h, 64, GBIT, 1e-5) / every)


def test_time_ratio_is_linear_in_the_steps_ratio_and_refuses_what_cannot_be_predicted(work):
    assert time_ratio(0.2, 0.4, 1.5) == pytest.approx(0.75)
    assert time_ratio(0.2, 0.4, 3.0) == pytest.approx(2 * time_ratio(0.2, 0.4, 1.5))
    with pytest.raises(RuntimeModelError):
        time_ratio(0.2, 0.4, 0.0)
    with pytest.raises(RuntimeModelError, match="power of two"):
        default_step(work, 96, GBIT, 0.0)


def test_the_cli_prints_every_row(capsys):
    assert main(["--workers", "64", "1024", "--rates", "10gbit", "--default-ratios", "1", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "P = 124,439,808" in out and out.count("| 10gbit |") == 6 and "1.5×:" in out
    assert "| 64 | default (4 tracker hops) |" in out and "| 1024 | default (6 tracker hops) |" in out
