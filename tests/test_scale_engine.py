"""The replica-axis engine of experiments/scale reproduces the library's trajectories on the simulator.

The engine is a second implementation of a gossip step, so it is held to the first: the same configuration run by
:func:`experiments.scale.reference.simulated_trajectory` (``gossip.simulate`` around the real
``gossip.DecentralizedDataParallel``, or ``gossip.Pipeline`` for the default pipeline) and by
:class:`experiments.scale.engine.Engine` (one ``(n, P)`` buffer) must give every rank the same parameters after every
step, at n = 8 and 16, for exact gossip, PowerGossip (rank 4, 2 power iterations, float16 messages), exact
trackers, AdamW, DDP, and the default pipeline (PowerGossip, sign trackers, momentum tracking with the gossiped mean
gradient's second moment, sampled every 4 steps here so that 12 steps see three samples; its trackers mixed once a
step at n = 8 and three times at 16), that with its trackers mixed twice at both n (``pipeline-two-hops``), and with
the second moment read off the trackers (``pipeline-tracker``); and on schedules with several peers (ring), idle
ranks and unequal weights (the Base-2 graph at n = 12) and random matchings.

Tolerance: ``atol = 1e-6`` on parameters of order 1 (rtol 0), over 12 steps; on this machine every difference is
exactly 0. The engine computes the gradients replica by replica (``grad_mode="loop"``, the kernels a rank runs) and
every mixing and update with the library's kernels on the library's operand layouts. The tolerance leaves room for
a BLAS that rounds a matrix differently when it is batched differently, not more: the compressed arms are not
continuous in rounding (a float16 product or a sign that flips jumps by a unit of the code), so a difference of
rounding there shows as 1e-4 to 1e-2 within a few steps, and so would any difference of algorithm (a weight, an
order, a sign, a missing step). The fast gradient modes (hand-batched GPT, vmap) are compared to the loop one
gradient by gradient, at float32 rounding.

Also pinned: the batched scaled-sign code equals the library's codec row by row, bit for bit, with the bytes of its
messages; mixing preserves the average over ranks; both ends of a one-peer edge hold bit-identical trackers; the
log2 n hops of the hypercube give every rank the mean; PowerGossip preserves the sum and leaves identical replicas
identical.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, grad

import topologies
from experiments.scale.config import EngineConfig
from experiments.scale.engine import Engine
from experiments.scale.mixing import consensus_sq, exact_gossip_, rank_order_sum_
from experiments.scale.powergossip import BatchedPowerGossip
from experiments.scale.reference import simulated_trajectory
from experiments.scale.replicas import Replicas, template_model
from experiments.scale.sign import BatchedChocoSign, message_bytes, sign_values
from experiments.scale.steps import StepPlan
from experiments.scale.study import sweep
from gossip.algorithms.scaled_sign import SignCodec
from gossip.app.corpus import load_corpus
from gossip.app.gpt import GPTConfig

TINY = {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 8, "batch": 2, "steps": 40, "warmup": 5}
STEPS = 12
ATOL = 1e-6
ARMS = {
    "exact-adamw": {"params": "exact", "trackers": "", "optimizer": "adamw"},
    "powergossip-adamw": {"params": "powergossip", "trackers": "", "optimizer": "adamw"},
    "exact-trackers-adamw": {"params": "exact", "trackers": "exact", "optimizer": "adamw"},
    "pipeline": {"second_moment_every": 4},  # gossip.Pipeline()'s parts, the second moment sampled every 4 steps
    "pipeline-tracker": {"second_moment": "tracker"},  # the second moment read off the trackers
    "pipeline-two-hops": {"second_moment": "sample", "second_moment_every": 4, "tracker_hops": 2},
    "ddp": {"params": "ddp", "trackers": "", "optimizer": "adamw"},
}


@pytest.fixture(scope="module")
def train() -> torch.Tensor:
    return load_corpus(None, block_size=TINY["block_size"]).train


def _compare(config: EngineConfig, train: torch.Tensor, steps: int = STEPS) -> Engine:
    reference = simulated_trajectory(config, train, steps)
    engine = Engine(config, train, "cpu", grad_mode="loop")
    start = engine.parameters.clone()
    engine_bytes = []
    for t, expected in enumerate(reference):
        losses = engine.step(t)
        where = f"{config.name}, n = {config.workers}, step {t}: "
        torch.testing.assert_close(engine.parameters, expected["params"], rtol=0, atol=ATOL, msg=where.__add__)
        torch.testing.assert_close(losses, expected["losses"], rtol=0, atol=ATOL, msg=where.__add__)
        engine_bytes.append(engine.bytes_per_worker())
    assert (engine.parameters - start).abs().max() > 1e-3  # it trained
    if config.params != "ddp":
        assert consensus_sq(engine.parameters) > 0  # the replicas differ: the mixing had something to do
    if config.params != "ddp":  # the bytes every rank's algorithm counted, on average, after every step
        assert engine_bytes == [float(r["bytes"].mean()) for r in reference]
    return engine


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("arm", ARMS)
def test_the_engine_reproduces_the_simulators_trajectory(arm, n, train):
    _compare(EngineConfig(name=arm, workers=n, **TINY, **ARMS[arm]), train)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's CUDA path needs a CUDA device")
@pytest.mark.parametrize(("arm", "loss_atol"), [("exact-adamw", 1e-3), ("pipeline", 2e-2)])
def test_the_engine_runs_on_cuda_unchanged_and_follows_the_simulator(arm, loss_atol, train):
    """On a GPU the engine runs the same algorithms (every rank's bytes equal the simulator's, which do not depend on
    rounding) and its losses stay within ``loss_atol`` of the simulator's on the CPU (other kernels round otherwise,
    and the sign codes amplify a rounding into a flipped bit)."""
    config = EngineConfig(name=arm, workers=8, **TINY, **ARMS[arm])
    reference = simulated_trajectory(config, train, STEPS)
    engine = Engine(config, train, "cuda")
    for t, expected in enumerate(reference):
        losses = engine.step(t).cpu()
        assert torch.isfinite(losses).all() and engine.parameters.is_cuda
        torch.testing.assert_close(losses, expected["losses"], rtol=0, atol=loss_atol, msg=f"{arm}, step {t}".__add__)
        assert engine.bytes_per_worker() == float(expected["bytes"].mean())


@pytest.mark.parametrize(("n", "schedule"), [(8, "ring"), (8, "random_matchings"), (12, "")])
def test_the_pipeline_is_reproduced_on_other_schedules(n, schedule, train):
    config = EngineConfig(
        name=f"pipeline-{schedule}",
        workers=n,
        schedule=schedule,
        second_moment="sample",
        second_moment_every=16,
        **TINY,
    )
    engine = _compare(config, train, steps=8)
    assert engine.schedule.name == (schedule or "base_graph")


def test_momentum_tracking_with_exact_trackers_and_an_all_reduced_mean_gradient_is_reproduced(train):
    config = EngineConfig(name="mt-exact", workers=8, trackers="exact", mean_gradient="allreduce", **TINY)
    _compare(config.replace(second_moment="sample", second_moment_every=3), train, steps=8)


def test_the_engines_default_arm_is_the_librarys_default_pipeline():
    """The sweeps' ``pipeline`` arm is ``gossip.Pipeline()`` as the library defines it: no collective in the step."""
    import gossip
    from experiments.scale.study import ARMS as STUDY_ARMS

    default, pipeline = EngineConfig(), gossip.Pipeline()
    assert STUDY_ARMS["pipeline"] == {} and default.is_pipeline()
    algorithm, ours = pipeline.algorithm(), default.powergossip()
    assert (ours.matrix_rank, ours.num_iterations, ours.gamma, ours.message_dtype) == (
        algorithm.matrix_rank,
        algorithm.num_iterations,
        algorithm.gamma,
        algorithm.message_dtype,
    )
    assert pipeline.tracking() == default.trackers == "sign"
    for n, hops in ((8, 1), (16, 3), (64, 4), (1024, 6)):  # once a step up to 8 workers, then ceil(log2(n) / 2) + 1
        assert EngineConfig(workers=n).tracker_hops == pipeline.hops(n) == hops
    library_sign, our_sign = gossip.ChocoSign(), default.tracking()
    assert (our_sign.gamma, our_sign.chunk, our_sign.levels) == (
        library_sign.gamma,
        library_sign.chunk,
        library_sign.levels,
    )
    assert default.optimizer == "momentum-tracking"
    assert (default.second_moment, default.sampling_every()) == (pipeline.second_moment, pipeline.sampling_every())
    assert default.second_moment == "sample"  # the mean gradient's second moment sampled and gossiped
    assert (default.mean_gradient, default.second_moment_every) == (
        pipeline.mean_gradient,
        pipeline.second_moment_every,
    )
    assert default.mean_gradient == "gossip"  # the second moment gossiped along the schedule, never all-reduced
    assert default.build_schedule().name == gossip.default_schedule(default.workers)
    pipelines = [c for c in sweep("strong") + sweep("weak") + sweep("topology") if "-pipeline" in c.name]
    assert len(pipelines) == 18
    assert all((c.mean_gradient, c.sampling_every(), c.trackers) == ("gossip", 64, "sign") for c in pipelines)


def test_the_sweeps_hold_what_they_vary_fixed_and_share_their_runs():
    strong, weak, topology = (sweep(name) for name in ("strong", "weak", "topology"))
    assert {c.workers * c.batch for c in strong} == {1024} and {c.workers for c in strong} == {16, 64, 256, 1024}
    assert {c.batch for c in weak + topology} == {4} and {c.workers for c in weak} == {16, 64, 256}
    assert {(c.workers, c.build_schedule().name) for c in topology if c.params != "ddp"} >= {
        (24, "base_graph"),
        (24, "random_matchings"),
        (96, "base_graph"),
        (256, "ring"),
        (64, "random_matchings"),
        (256, "one_peer_hypercube"),
    }
    every = strong + weak + topology
    assert all(c.steps == 1000 for c in every)
    ddp = {(c.workers, c.batch) for c in every if c.params == "ddp"}
    assert {(c.workers, c.batch) for c in every} == ddp  # every gossip run has its DDP twin: same n, b and seeds
    named = {c.name: c for c in every}  # one name, one configuration: shared runs are the same run
    assert all(named[c.name] == c for c in every)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap of the CPU attention: a loop inside
def test_the_fast_gradient_modes_agree_with_the_loop_to_rounding():
    config = GPTConfig(block_size=8, n_layer=2, n_embd=16, n_head=2)
    model = template_model(config, 0, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (4, 3, 8), generator=generator) for _ in range(2))
    grads, losses = {}, {}
    for mode in ("loop", "vmap", "batched"):
        replicas = Replicas(model, 4, mode)
        replicas.flat.add_(0.02 * torch.randn(replicas.flat.shape, generator=torch.Generator().manual_seed(2)))
        losses[mode], grads[mode] = replicas.gradients(x, y), replicas.grad.clone()
    for mode in ("vmap", "batched"):
        torch.testing.assert_close(losses[mode], losses["loop"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grads[mode], grads["loop"], rtol=1e-4, atol=1e-6)
    # and the loop is the module's own backward, bit for bit
    module = template_model(config, 0, torch.device("cpu"))
    replicas = Replicas(module, 4, "loop")
    params = {k: v[1].clone() for k, v in replicas.views.items()}
    expected = grad(lambda p: functional_call(module, p, (x[1], y[1]))[1])(params)
    replicas.gradients(x, y)
    assert all(torch.equal(replicas.grad_views[k][1], expected[k]) for k in expected)


@pytest.mark.parametrize("levels", [1, 2, 4])
@pytest.mark.parametrize(("numel", "chunk"), [(1000, 256), (1792, 256), (777, 32), (5, 256)])
def test_the_batched_sign_code_is_the_librarys_row_by_row(numel, chunk, levels):
    generator = torch.Generator().manual_seed(numel + levels)
    residual = torch.randn(4, numel, generator=generator) * torch.rand(4, 1, generator=generator)
    residual[0, :3] = 0.0  # zeros count as +
    values = sign_values(residual, chunk, levels)
    for row in range(4):
        message, expected = SignCodec(chunk, levels).encode(residual[row].clone())
        assert torch.equal(values[row], expected)
        assert message_bytes(numel, chunk, levels) == sum(t.numel() * t.element_size() for t in message)


SCHEDULES = [("one_peer_hypercube", 8), ("ring", 8), ("random_matchings", 8), ("base_graph", 12)]


@pytest.mark.parametrize(("name", "n"), SCHEDULES)
def test_exact_and_rank_order_mixing_preserve_the_average(name, n):
    schedule = topologies.by_name(name, n)
    rows = torch.randn(n, 300, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    mean = rows.mean(dim=0)
    for t in range(3):
        plan = StepPlan.build(schedule, t, torch.device("cpu"))
        for mix in (exact_gossip_, rank_order_sum_):
            mixed = rows.clone()
            mix(mixed, plan)
            torch.testing.assert_close(mixed.mean(dim=0), mean, rtol=0, atol=1e-12)
            torch.testing.assert_close(mixed, torch.from_numpy(schedule.mixing_matrix(t)) @ rows, rtol=0, atol=1e-12)


def test_one_peer_edges_end_bit_identical_and_the_hypercube_averages_exactly():
    n = 16
    schedule = topologies.one_peer_hypercube(n)
    rows = torch.randn(n, 1000, generator=torch.Generator().manual_seed(0))
    mean = rows.double().mean(dim=0)
    for t in range(int(math.log2(n))):
        plan = StepPlan.build(schedule, t, torch.device("cpu"))
        rank_order_sum_(rows, plan)
        partner = plan.slots[0].index
        assert torch.equal(rows, rows[partner])  # both ends of every edge hold the same bits
    torch.testing.assert_close(rows.double(), mean.expand(n, -1), rtol=0, atol=1e-6)


def _replicas(n: int) -> Replicas:
    model = template_model(GPTConfig(block_size=8, n_layer=2, n_embd=16, n_head=2), 0, torch.device("cpu"))
    return Replicas(model, n, "loop")


def test_powergossip_preserves_the_sum_and_leaves_identical_replicas_identical():
    import gossip

    n = 8
    schedule = topologies.one_peer_hypercube(n)
    replicas = _replicas(n)
    algorithm = BatchedPowerGossip(replicas, n, gossip.PowerGossip(4, 2, message_dtype=torch.float16))
    before = replicas.flat.clone()
    algorithm.mix_(replicas.flat, StepPlan.build(schedule, 0, torch.device("cpu")))
    assert torch.equal(replicas.flat, before)  # R = 0: nothing moves, the warm factors stay
    replicas.flat.add_(0.01 * torch.randn(replicas.flat.shape, generator=torch.Generator().manual_seed(3)))
    total, spread = replicas.flat.double().sum(dim=0), consensus_sq(replicas.flat)
    for t in range(1, 4):
        algorithm.mix_(replicas.flat, StepPlan.build(schedule, t, torch.device("cpu")))
    torch.testing.assert_close(replicas.flat.double().sum(dim=0), total, rtol=0, atol=1e-5)
    assert consensus_sq(replicas.flat) < spread


def test_sign_trackers_preserve_the_sum_over_ranks():
    n = 8
    schedule = topologies.one_peer_hypercube(n)
    replicas = _replicas(n)
    mixing = BatchedChocoSign(replicas.segments)
    y = torch.randn(replicas.flat.shape, generator=torch.Generator().manual_seed(4))
    total = y.double().sum(dim=0)
    for t in range(5):
        mixing.mix_(y, StepPlan.build(schedule, t, torch.device("cpu")))
    torch.testing.assert_close(y.double().sum(dim=0), total, rtol=0, atol=1e-4)


def test_the_report_pairs_each_arm_with_its_ddp_twin():
    from experiments.scale.report import gaps

    def summary(config, seed, loss, sent):
        n, b = (int(part[1:]) for part in config.split("-")[:2])
        final = {"final_avg_val_loss": loss, "final_local_val_loss": loss + 0.01, "final_consensus": 0.1}
        return {"config": config, "seed": seed, "workers": n, "batch": b, "warmup": 3, "step": 30, **final,
                "bytes_per_worker_per_step": sent}  # fmt: skip

    rows = [summary("n16-b4-ddp", 0, 1.5, 100.0), summary("n16-b4-pipeline", 0, 1.6, 10.0),
            summary("n16-b4-pipeline", 1, 1.4, 10.0), summary("n64-b4-pipeline", 0, 1.0, 1.0)]  # fmt: skip
    curve = [
        {"config": "n16-b4-ddp", "seed": 0, "step": s, "avg_val_loss": v} for s, v in ((10, 2), (20, 1.6), (30, 1.5))
    ]
    (only,) = gaps(rows, curve)  # seed 1 and n = 64 have no DDP twin
    assert (only["arm"], only["seed"], only["ddp_equivalent_step"], only["steps_ratio_at_least"]) == (
        "pipeline",
        0,
        20,
        1.5,
    )
    assert only["gap"] == pytest.approx(0.1) and only["bytes_per_step_over_ddp"] == pytest.approx(0.1)


def test_the_report_tells_a_missing_ddp_curve_from_one_never_reached():
    from experiments.scale.report import equivalent_step_text, gaps

    summary = [
        {"config": f"n16-b4-{arm}", "seed": 0, "workers": 16, "batch": 4, "warmup": 3, "step": 30,
         "final_avg_val_loss": loss,
         "final_local_val_loss": loss, "final_consensus": 0.1, "bytes_per_worker_per_step": 1.0}
        for arm, loss in (("ddp", 1.5), ("pipeline", 1.2))
    ]  # fmt: skip
    curve = [{"config": "n16-b4-ddp", "seed": 0, "step": s, "avg_val_loss": v} for s, v in ((10, 2), (20, 1.5))]
    (below,) = gaps(summary, curve)  # the arm ends below anything DDP's curve reaches
    (missing,) = gaps(summary, [])
    assert below["ddp_equivalent_step"] is None and missing["ddp_equivalent_step"] is None
    assert (equivalent_step_text(below), equivalent_step_text(missing)) == ("ends below DDP", "no DDP curve")


def test_the_sweeps_warm_up_as_the_library_does_unless_told_and_name_any_other_warm_up():
    from gossip.app.train import TrainConfig, resolve

    library = resolve(TrainConfig(steps=1000), 16)[0].warmup_steps
    weak, thirty, explicit = sweep("weak"), sweep("weak", warmup=30), sweep("weak", warmup=library)
    assert {c.warmup_steps() for c in weak} == {library} == {100}
    assert explicit == weak  # the library's warm-up named explicitly is the same run, under the same name
    assert {c.warmup_steps() for c in thirty} == {30}
    assert [c.name for c in thirty] == [f"{c.name}-warmup30" for c in weak]
    assert [c.replace(name="", warmup=None) for c in thirty] == [c.replace(name="") for c in weak]
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        sweep("weak", warmup=-1)


def test_the_committed_sweep_rows_name_their_warm_up_unless_it_is_the_librarys():
    import csv

    from experiments.scale.study import RESULTS
    from gossip.app.train import default_warmup_steps

    rows = []
    for path in [RESULTS / "summary.csv", *RESULTS.glob("*_sample/summary.csv")]:  # the ablation names its arms
        with path.open() as handle:
            rows += list(csv.DictReader(handle))
    assert len(rows) > 23
    for row in rows:
        warmup, library = int(row["warmup"]), default_warmup_steps(int(row["step"]))
        assert row["config"].endswith(f"-warmup{warmup}") == (warmup != library), row["config"]


def test_a_sweep_run_of_other_steps_has_its_own_name_and_the_warm_up_of_its_length():
    weak, short = sweep("weak"), sweep("weak", steps=500)
    assert [c.name for c in short] == [f"{c.name}-s500" for c in weak]
    assert {c.warmup_steps() for c in short} == {50}  # the library's for 500 steps: a tenth
    assert [c.name for c in sweep("weak", steps=500, warmup=30)] == [f"{c.name}-s500-warmup30" for c in weak]


def test_the_report_pairs_a_run_only_with_the_ddp_run_of_its_length_and_warm_up():
    from experiments.scale.report import gaps

    def summary(config, warmup, loss, steps=30):
        return {"config": config, "seed": 0, "workers": 16, "batch": 4, "warmup": warmup, "step": steps,
                "final_avg_val_loss": loss, "final_local_val_loss": loss, "final_consensus": 0.1,
                "bytes_per_worker_per_step": 1.0}  # fmt: skip

    rows = [summary("n16-b4-ddp", 3, 1.5), summary("n16-b4-ddp-warmup10", 10, 1.7),
            summary("n16-b4-pipeline", 3, 1.52), summary("n16-b4-pipeline-ring-warmup10", 10, 1.6)]  # fmt: skip
    paired = {(r["arm"], r["warmup"]): r["ddp_final_avg_val_loss"] for r in gaps(rows, [])}
    assert paired == {("pipeline", 3): 1.5, ("pipeline-ring", 10): 1.7}
    assert gaps(rows[1:3], []) == []  # a run on another warm-up than DDP's is not its twin
    longer = [summary("n16-b4-ddp", 3, 1.5), summary("n16-b4-pipeline-s60", 3, 1.4, steps=60)]
    assert gaps(longer, []) == []  # nor a run of another length


def test_a_sweep_and_its_report_run_end_to_end_and_pair_runs_of_one_warm_up(tmp_path):
    from experiments.scale import report, study
    from experiments.shared import read_csv

    runs = ["--only", "smoke-n8-b2-ddp-s6-warmup2", "smoke-n8-b2-pipeline-s6-warmup2"]
    args = ["--sweep", "smoke", "--steps", "6", "--record-every", "3", "--seeds", "0", "--device", "cpu"]
    threads = torch.get_num_threads()
    try:
        assert study.main([*args, *runs, "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    summary = read_csv(tmp_path / "summary.csv")
    assert [(r["config"], r["warmup"]) for r in summary] == [(name, 2) for name in runs[1:]]
    assert report.main(["--results", str(tmp_path)]) == 0
    (row,) = read_csv(tmp_path / "gaps.csv")
    assert (row["workers"], row["warmup"], row["arm"], row["ddp_curve_points"]) == (8, 2, "pipeline", 2)


def test_a_name_in_only_that_is_not_a_run_of_the_sweeps_is_an_error_not_an_empty_sweep(tmp_path, capsys):
    """A misspelt configuration, or one that --arms or --max-workers leaves out, stops the command before any run
    with the name in the message, instead of running the rest and exiting 0."""
    from experiments.scale import study

    common = ["--sweep", "smoke", "--steps", "6", "--seeds", "0", "--device", "cpu", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        for wrong, extra in [
            ("smoke-n8-b2-pipelin-s6-warmup2", []),
            ("smoke-n8-b2-ddp-s6-warmup2", ["--arms", "pipeline"]),
        ]:
            with pytest.raises(SystemExit) as stopped:
                study.main([*common, *extra, "--only", "smoke-n8-b2-pipeline-s6-warmup2", wrong])
            assert stopped.value.code == 2 and f"--only: {wrong}: not a run of --sweep smoke" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    assert not (tmp_path / "summary.csv").exists()  # nothing ran


def test_the_report_on_a_folder_without_runs_names_what_is_missing(tmp_path, capsys):
    from experiments.scale import report

    with pytest.raises(SystemExit) as stopped:
        report.main(["--results", str(tmp_path)])
    assert stopped.value.code == 2 and f"no summary.csv in {tmp_path}" in capsys.readouterr().err


def test_a_run_cut_short_leaves_its_curve_so_far_and_its_rerun_replaces_it(tmp_path, monkeypatch):
    from experiments.scale import study
    from experiments.shared import read_csv

    name, finished = "smoke-n8-b2-ddp-s6-warmup2", "smoke-n8-b2-pipeline-s6-warmup2"
    common = ["--sweep", "smoke", "--steps", "6", "--record-every", "3", "--seeds", "0", "--device", "cpu"]
    common += ["--out", str(tmp_path)]
    step = Engine.step

    def taken_back_at_step_4(engine, t):
        if t == 4:
            raise KeyboardInterrupt("the machine is taken back")
        return step(engine, t)

    threads = torch.get_num_threads()
    try:
        assert study.main([*common, "--only", finished]) == 0
        other = read_csv(tmp_path / "steps.csv")  # a finished run of another configuration: left alone
        monkeypatch.setattr(Engine, "step", taken_back_at_step_4)
        with pytest.raises(KeyboardInterrupt):
            study.main([*common, "--only", name, finished])
        cut = [r for r in read_csv(tmp_path / "steps.csv") if r["config"] == name]
        assert [r["step"] for r in cut] == [3]  # its curve up to the record before the cut
        assert [r["config"] for r in read_csv(tmp_path / "summary.csv")] == [finished]  # not a finished run
        monkeypatch.setattr(Engine, "step", step)
        assert study.main([*common, "--only", name, finished]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = read_csv(tmp_path / "steps.csv")
    rerun = [r for r in rows if r["config"] == name]
    assert [r["step"] for r in rerun] == [3, 6]  # the rerun's records, once
    assert cut[0] == rerun[0] | {"seconds": cut[0]["seconds"]}  # the same seed: the same record, bar the time
    assert [r for r in rows if r["config"] != name] == other
    assert [r["config"] for r in read_csv(tmp_path / "summary.csv")] == [finished, name]


def test_a_budget_skips_the_runs_predicted_not_to_fit_and_runs_the_rest_in_the_order_named(
    tmp_path, capsys, monkeypatch
):
    from experiments.scale import study
    from experiments.shared import read_csv

    order = ["smoke-n12-b2-ddp-s6-warmup2", "smoke-n8-b2-pipeline-s6-warmup2", "smoke-n8-b2-ddp-s6-warmup2"]
    predicted = dict(zip(order, (5.0, 50.0, 5.0), strict=True))
    asked = []

    def predict(config, *_):
        asked.append(config.name)
        return predicted[config.name]

    monkeypatch.setattr(study, "predicted_seconds", predict)
    args = ["--sweep", "smoke", "--steps", "6", "--record-every", "3", "--seeds", "0", "1", "--device", "cpu"]
    threads = torch.get_num_threads()
    try:
        assert study.main([*args, "--budget", "30", "--only", *order, "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    ran = [(r["config"], r["seed"]) for r in read_csv(tmp_path / "summary.csv")]
    assert ran == [(order[0], 0), (order[2], 0), (order[0], 1), (order[2], 1)]  # seed by seed
    assert asked == order  # one prediction a configuration, whatever its seeds
    out = capsys.readouterr().out
    assert out.count(f"{order[1]} seed 0: skipped, predicted 50 s with") == 1 and f"{order[1]} seed 1: skipped" in out


def test_the_predicted_time_of_a_run_grows_with_its_steps():
    from experiments.scale import study

    config = study.sweep("smoke", steps=6)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        short = study.predicted_seconds(config, "cpu", "batched", record_every=3)
        long = study.predicted_seconds(config.replace(steps=6000), "cpu", "batched", record_every=3)
    finally:
        torch.set_num_threads(threads)
    assert 0 < short < long and math.isfinite(long)


def test_the_report_on_the_committed_results_prints_and_keeps_what_it_cannot_redo(tmp_path, capsys):
    """``steps.csv`` is not committed: the table prints, ``gaps.csv`` keeps its DDP-equivalent steps."""
    import shutil

    from experiments.scale import report
    from experiments.scale.study import RESULTS

    for name in ("summary.csv", "gaps.csv"):
        shutil.copy(RESULTS / name, tmp_path / name)
    before = (tmp_path / "gaps.csv").read_text()
    assert report.main(["--results", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| 256 × 4 | 1000 | 30 | pipeline | +0.026 (1 seed) |" in table and "no DDP curve" in table
    assert (tmp_path / "gaps.csv").read_text() == before and not (tmp_path / "validation_loss.png").exists()
