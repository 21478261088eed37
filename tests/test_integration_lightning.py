"""gossip.integrations.lightning: Lightning's Trainer with GossipStrategy, 4 CPU devices on Gloo, one job.

tests/helpers/lightning_worker.py runs every scenario in the same 4 processes (its docstring lists them); each test
below pins one property of what they recorded. Skipped without pytorch_lightning (the ``lightning`` extra, which
the ``test`` extra installs). The example (examples/lightning_gossip.py) runs under Lightning's own launcher, and
tests/helpers/lightning_launched_worker.py on 2 processes started by torchrun and by ``mpiexec`` (Lightning's
``TorchElasticEnvironment`` and ``MPIEnvironment``; nothing but Lightning sets up torch.distributed there), and on
2 processes started with the variables srun gives its tasks (``SLURMEnvironment``; there is no Slurm here, see
:func:`srun_tasks`) on the unified ``lightning`` package (``import lightning.pytorch as pl``), which the test extra
installs beside ``pytorch_lightning``. Construction-time refusals run in this process.
"""

from __future__ import annotations

import random
import re
import socket
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from helpers.launch import CPU_ONLY, REPO, _env, launch, mpiexec, python, start_worker, wait_for_all

N = 4
STEP = ["forward", "backward", "mix", "update", "start"]  # after the first step's start, each step is this


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("lightning_worker.py", tmp_path_factory.mktemp("lightning"), [], backend="gloo", n=N, timeout=400)[0]


@pytest.mark.multiprocess
def test_the_strategys_model_is_the_gossip_wrapper_and_no_ddp(ranks):
    assert {(r["pipeline"]["model_type"], r["pipeline"]["ddp_modules"]) for r in ranks} == {
        ("DecentralizedDataParallel", 0)
    }


@pytest.mark.multiprocess
def test_each_step_runs_forward_backward_then_mixes_then_updates_as_the_plain_loop(ranks):
    for result in ranks:
        events = result["pipeline"]["events"]
        assert events[: 1 + 4 * len(STEP)] == ["start", *STEP * 4]
        assert events == result["plain"]["events"]


@pytest.mark.multiprocess
def test_the_lightning_run_has_the_plain_loops_losses(ranks):
    for result in ranks:
        assert len(result["pipeline"]["losses"]) == 4
        assert result["pipeline"]["losses"] == pytest.approx(result["plain"]["losses"], rel=1e-6, abs=1e-7)
        assert torch.allclose(result["pipeline"]["final"], result["plain"]["final"], rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
def test_a_module_written_for_ddp_trains_the_default_pipeline_when_only_the_strategy_changes(ranks):
    for result in ranks:
        adamw = result["one_line"]["adamw"]
        assert adamw["optimizer"] == "MomentumTrackingAdamW"
        assert (adamw["losses"], adamw["events"]) == (result["pipeline"]["losses"], result["pipeline"]["events"])
        assert torch.equal(adamw["final"], result["pipeline"]["final"])


@pytest.mark.multiprocess
def test_the_lr_scheduler_of_the_replaced_adamw_schedules_the_pipeline_optimizer_without_a_warning(ranks):
    for result in ranks:
        scheduled = result["one_line"]["adamw-scheduled"]
        assert scheduled["optimizer"] == "MomentumTrackingAdamW"
        assert scheduled["lrs"] == pytest.approx([3e-2 * 0.5**step for step in range(4)], rel=1e-12)
        assert scheduled["warnings"] == []


@pytest.mark.multiprocess
def test_momentum_tracking_false_keeps_the_returned_adamw(ranks):
    for result in ranks:
        kept = result["one_line"]["kept"]
        assert kept["optimizer"] == "AdamW"
        assert kept["losses"] != result["one_line"]["adamw"]["losses"]


@pytest.mark.multiprocess
def test_manual_optimization_follows_the_same_trajectory(ranks):
    for result in ranks:
        assert result["manual"]["losses"] == pytest.approx(result["pipeline"]["losses"], rel=1e-6, abs=1e-7)
        assert result["manual"]["events"] == result["pipeline"]["events"]


@pytest.mark.multiprocess
def test_bf16_mixed_trains_under_autocast_close_to_float32(ranks):
    for result in ranks:
        assert (result["bf16"]["dtypes"], result["bf16"]["parameters"]) == (["torch.bfloat16"], ["torch.float32"])
        assert result["bf16"]["losses"] == pytest.approx(result["pipeline"]["losses"], rel=5e-2, abs=1e-2)


@pytest.mark.multiprocess
def test_ring_gossip_leaves_the_replicas_different(ranks):
    finals = [r["ring"]["final"] for r in ranks]
    assert all(not torch.allclose(finals[0], other) for other in finals[1:])


@pytest.mark.multiprocess
def test_a_complete_graph_mixes_every_replica_to_the_same_average(ranks):
    for step in range(2):
        mixed = [r["complete"]["pre_update"][step] for r in ranks]
        assert all(torch.allclose(mixed[0], other, rtol=0, atol=1e-6) for other in mixed[1:])
    assert not torch.allclose(ranks[0]["ring"]["pre_update"][1], ranks[1]["ring"]["pre_update"][1])


@pytest.mark.multiprocess
def test_validation_on_the_average_is_identical_on_every_rank(ranks):
    losses = [r["ring"]["val_losses"] for r in ranks]
    assert len(losses[0]) == 2 * 4  # 4 batches after steps 2 and 4, while the replicas differ
    assert all(other == losses[0] for other in losses[1:])


@pytest.mark.multiprocess
def test_validation_during_fit_never_starts_an_exchange(ranks):
    """Between a validation's start and end the wrapper's step count and its communicator's exchanged bytes stay
    put, on the average (``ring``) and locally (``local``); the exchange of the step after it is in flight."""
    for result in ranks:
        for scenario in ("ring", "local"):
            validations = result[scenario]["validations"]
            assert [v["start"][0] for v in validations] == [2, 4], scenario
            assert all(v["start"] == v["end"] for v in validations), (scenario, validations)
            assert all(v["start"][1] > 0 for v in validations), scenario


@pytest.mark.multiprocess
def test_averaged_validation_runs_on_the_mean_of_the_replicas(ranks):
    for index in range(2):
        trained = [r["ring"]["validations"][index]["trained"] for r in ranks]
        average = torch.stack(trained).mean(dim=0)
        for result in ranks:
            assert torch.allclose(result["ring"]["validations"][index]["validated"], average, rtol=0, atol=1e-6)


@pytest.mark.multiprocess
def test_local_validation_runs_on_each_ranks_own_replica(ranks):
    for result in ranks:
        for validation in result["local"]["validations"]:
            assert torch.equal(validation["validated"], validation["trained"])
    losses = [r["local"]["val_losses"] for r in ranks]
    assert len(losses[0]) == 2 * 4
    assert all(other != losses[0] for other in losses[1:])  # ring gossip: the replicas, and their losses, differ


@pytest.mark.multiprocess
def test_test_and_predict_after_fit_run_the_module_without_gossip_and_agree_on_every_rank(ranks):
    """After ``fit`` every rank's module is the average: ``trainer.test`` and ``trainer.predict`` (the same data on
    every rank) call it directly, with no wrapper, no gossip group and no gossip thread."""
    for result in ranks:
        assert result["local"]["held"] == [("Regression", False, [])] * 8  # 4 test and 4 predict batches
    tested = [r["local"]["tested"] for r in ranks]
    assert len(tested[0]) == 1 and set(tested[0][0]) == {"test_loss"}
    assert all(other == tested[0] for other in tested[1:])
    predicted = [r["local"]["predicted"] for r in ranks]
    assert predicted[0].shape == (64, 1)
    assert all(torch.equal(other, predicted[0]) for other in predicted[1:])
    assert all(torch.equal(r["local"]["final"], ranks[0]["local"]["final"]) for r in ranks)


@pytest.mark.multiprocess
def test_two_optimizers_are_refused_by_name_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        refused = result["refused"]["two optimizers"]
        assert refused.startswith(f"ConfigurationError: rank {rank}: step 0: GossipStrategy: "), refused
        assert "returned 2 optimizers" in refused


@pytest.mark.multiprocess
def test_lbfgs_is_refused_by_name_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        refused = result["refused"]["LBFGS"]
        assert refused.startswith(f"ConfigurationError: rank {rank}: step 0: GossipStrategy: LBFGS evaluates"), refused


@pytest.mark.multiprocess
def test_sync_batchnorm_is_refused_by_name_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        refused = result["refused"]["sync_batchnorm"]
        assert refused.startswith(f"ConfigurationError: rank {rank}: GossipStrategy: Trainer(sync_batchnorm=True)")


@pytest.mark.multiprocess
def test_a_grad_scaler_16_mixed_precision_is_refused_by_name_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        refused = result["refused"]["GradScaler"]
        assert refused.startswith(f"ConfigurationError: rank {rank}: GossipStrategy: precision='16-mixed'"), refused
        assert "bf16-mixed" in refused


@pytest.mark.multiprocess
def test_gradient_accumulation_is_one_gossip_step_per_optimizer_step(ranks):
    """Run with ``strategy="gossip"``, the name ``import gossip.integrations.lightning`` registers."""
    for result in ranks:
        assert result["accumulate"]["strategy"] == "GossipStrategy"
        assert result["accumulate"]["gossip_steps"] == 2
        events = result["accumulate"]["events"]
        assert events[:11] == ["start", *["forward", "backward"] * 2, "mix", "update", "start", "forward", "backward",
                               "forward"]  # fmt: skip


@pytest.mark.multiprocess
def test_a_checkpoint_holds_the_average_and_resume_continues_bit_for_bit(ranks):
    saved = [r["resume"]["saved"] for r in ranks]
    assert [len(s) for s in saved] == [2] * N  # steps 4 and 8
    for index in range(2):
        average = torch.stack([s[index][1] for s in saved]).mean(dim=0)
        assert torch.allclose(saved[0][index][0], average, rtol=0, atol=1e-6)
    assert {"epoch=3-step=4.ckpt", "epoch=3-step=4.ckpt.gossip"} <= set(ranks[0]["resume"]["files"])
    for result in ranks:
        assert result["resume"]["resumed_losses"] == result["resume"]["straight_losses"][4:]
        assert torch.equal(result["resume"]["resumed"], result["resume"]["straight"])


@pytest.mark.multiprocess
def test_no_gossip_or_gloo_thread_is_left_after_fit(ranks):
    for result in ranks:
        threads = result["threads"]
        assert all(after == threads["baseline"] for after in threads["after"].values()), threads


@pytest.mark.multiprocess
def test_the_example_trains_under_lightnings_own_launcher(tmp_path):
    """examples/lightning_gossip.py with ``devices=2``: Lightning starts the second process itself (popen)."""
    command = [python(), str(REPO / "examples" / "lightning_gossip.py"), "--devices", "2", "--epochs", "1"]
    job = subprocess.run(command, cwd=tmp_path, env=_env(CPU_ONLY), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-5000:] + job.stderr[-5000:]
    found = re.search(r"2 processes, 16 steps: validation loss ([\d.]+) -> ([\d.]+)", job.stdout)
    assert found is not None, job.stdout[-3000:]
    assert float(found.group(2)) < float(found.group(1))


LAUNCHED = 2  # processes started by an outside launcher


#: (launcher, Lightning package) of each run of lightning_launched_worker.py
LAUNCHES = [("torchrun", "pytorch_lightning"), ("mpiexec", "pytorch_lightning"), ("srun", "lightning.pytorch")]


def _slurm_job_port() -> tuple[str, int]:
    """A Slurm job id whose port under Lightning's ``SLURMEnvironment`` (15000 + the id's last 4 digits) is free."""
    for port in random.sample(range(15000, 25000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"73{port - 15000:04d}", port
    raise RuntimeError("no free port in 15000-24999 for the emulated Slurm job")


def srun_tasks(out: Path, package: str) -> tuple[list[dict], int]:
    """lightning_launched_worker.py as ``srun --nodes=1 --ntasks-per-node=2`` would start it, emulated: 2 processes
    started here with the per-task variables srun sets (and no torchrun, MPI or MASTER_* variable).

    Returns:
        The per-rank results, and the port Lightning should have derived from the job id.
    """
    job_id, port = _slurm_job_port()
    job = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "python", "SLURM_NTASKS": str(LAUNCHED),
           "SLURM_NTASKS_PER_NODE": str(LAUNCHED), "SLURM_TASKS_PER_NODE": str(LAUNCHED), "SLURM_NNODES": "1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_NODEID": "0", "SLURMD_NODENAME": "localhost", "GOSSIP_TEST_LIGHTNING": package}  # fmt: skip
    argv = [str(REPO / "tests" / "helpers" / "lightning_launched_worker.py"), str(out), str(LAUNCHED)]
    consoles = [out / f"task{r}.console" for r in range(LAUNCHED)]
    tasks = [
        start_worker(argv, {**job, **CPU_ONLY, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}, console)
        for r, console in enumerate(consoles)
    ]
    wait_for_all(tasks, timeout=300)
    output = "\n".join(console.read_text(errors="replace") for console in consoles)
    assert all(task.returncode == 0 for task in tasks), output[-8000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(LAUNCHED)], port


@pytest.fixture(scope="module", params=LAUNCHES, ids=["torchrun", "mpiexec", "srun-emulated-unified-lightning"])
def launched(request, tmp_path_factory):
    """``(package, environment class, per-rank results)`` of lightning_launched_worker.py on 2 processes."""
    launcher, package = request.param
    out = tmp_path_factory.mktemp(launcher)
    extra = {"GOSSIP_TEST_LIGHTNING": package}
    if launcher == "srun":
        results, port = srun_tasks(out, package)
        assert [r["environment"]["main_port"] for r in results] == [port] * LAUNCHED
        return package, "SLURMEnvironment", results
    if launcher == "mpiexec":
        mpiexec()  # fails without the mpich wheel (the test extra installs it with mpi4py, which MPIEnvironment needs)
        with pytest.MonkeyPatch.context() as patch:  # launch() passes the test process's environment on
            patch.setenv("GOSSIP_TEST_LIGHTNING", package)
            results = launch("lightning_launched_worker.py", out, [str(LAUNCHED)], backend="mpi", n=LAUNCHED,
                             timeout=300)[0]  # fmt: skip
        return package, "MPIEnvironment", results
    command = [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={LAUNCHED}",
               str(REPO / "tests" / "helpers" / "lightning_launched_worker.py"), str(out), str(LAUNCHED)]  # fmt: skip
    job = subprocess.run(command, cwd=out, env=_env({**CPU_ONLY, **extra}), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-5000:] + job.stderr[-5000:]
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(LAUNCHED)]
    return package, "TorchElasticEnvironment", results


@pytest.mark.multiprocess
def test_under_an_outside_launcher_the_strategy_is_built_on_the_trainers_package(launched):
    """The unified ``lightning`` package's run never imports ``pytorch_lightning``, nor the other way round."""
    package = launched[0]
    for result in launched[2]:
        assert result["package"] == {"asked": package, "chosen": package, "trainer": f"{package}.trainer.trainer",
                                     "strategy_base": f"{package}.strategies.ddp", "loaded": [package]}  # fmt: skip


@pytest.mark.multiprocess
def test_under_an_outside_launcher_lightning_runs_on_the_launchers_processes(launched):
    _, environment, ranks = launched
    for rank, result in enumerate(ranks):
        found = {key: value for key, value in result["environment"].items() if key != "main_port"}
        assert found == {"class": environment, "external": True, "world_size": LAUNCHED, "rank": rank,
                         "local_rank": rank, "node_rank": 0, "dist_rank": rank}  # fmt: skip


@pytest.mark.multiprocess
def test_under_an_outside_launcher_the_model_is_the_gossip_wrapper_and_no_ddp(launched):
    for result in launched[2]:
        fit = result["fit"]
        assert (fit["model_type"], fit["ddp_modules"], fit["gossip_steps"]) == ("DecentralizedDataParallel", 0, 4)


@pytest.mark.multiprocess
def test_under_an_outside_launcher_training_is_the_plain_loops_bit_for_bit(launched):
    """Validation on the average after steps 2 and 4 changes nothing of the trajectory either."""
    for result in launched[2]:
        assert result["fit"]["events"] == result["plain"]["events"]
        assert result["fit"]["events"][: 1 + 4 * len(STEP)] == ["start", *STEP * 4]
        assert result["fit"]["losses"] == result["plain"]["losses"]
        assert torch.equal(result["fit"]["replica"], result["plain"]["final"])


@pytest.mark.multiprocess
def test_under_an_outside_launcher_validation_is_the_averages_on_every_rank(launched):
    ranks = launched[2]
    replicas = [r["fit"]["replica"] for r in ranks]
    assert not torch.allclose(replicas[0], replicas[1])  # compressed gossip: the replicas differ
    losses = [r["fit"]["val_losses"] for r in ranks]
    assert len(losses[0]) == 2 * 4 and losses[1] == losses[0]  # the same data, the same (averaged) model


@pytest.mark.multiprocess
def test_under_an_outside_launcher_every_rank_ends_with_the_average_and_no_thread_left(launched):
    ranks = launched[2]
    average = torch.stack([r["fit"]["replica"] for r in ranks]).mean(dim=0)
    for result in ranks:
        assert torch.allclose(result["fit"]["final"], average, rtol=0, atol=1e-7)
        threads = result["threads"]
        assert threads["after"] == threads["baseline"], threads
        assert not any(name.startswith("gossip") for name in threads["baseline"]), threads


@pytest.mark.parametrize(
    ("arguments", "error", "named"),
    [
        ({"evaluate": "averaged"}, "InvalidArgumentError", r"GossipStrategy\(evaluate=...\) must be one of"),
        ({"wrap": print, "pipeline": "pipeline"}, "InvalidArgumentError", "GossipStrategy: pass either a pipeline"),
        ({"wrap": print, "wrapper_kwargs": {"seed": 1}}, "InvalidArgumentError", "GossipStrategy: pass either"),
        ({"wrap": "ring"}, "ArgumentTypeError", "GossipStrategy: wrap must be callable"),
        ({"pipeline": "default"}, "ArgumentTypeError", "GossipStrategy: pipeline must be a gossip.Pipeline"),
    ],
    ids=["evaluate", "pipeline-and-wrap", "wrapper-kwargs-and-wrap", "wrap-not-callable", "pipeline-type"],
)
def test_settings_it_cannot_take_are_refused_by_name_when_the_strategy_is_built(arguments, error, named):
    from gossip import Pipeline, errors
    from gossip.integrations.lightning import GossipStrategy

    if arguments.get("pipeline") == "pipeline":  # a real pipeline beside wrap
        arguments = {**arguments, "pipeline": Pipeline()}
    with pytest.raises(getattr(errors, error), match=named):
        GossipStrategy(**arguments)


def _adamw_like(kind: str, **settings) -> torch.optim.Optimizer:
    return getattr(torch.optim, kind)(torch.nn.Linear(3, 2).parameters(), lr=0.1, **settings)


def test_adopting_adamw_keeps_its_param_group_dicts_and_hyper_parameters():
    from gossip import Pipeline
    from gossip.integrations.lightning import adopt_adam

    adamw = _adamw_like("AdamW", betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
    adopted = adopt_adam(adamw, Pipeline(second_moment="sample", second_moment_every=16))
    assert type(adopted).__name__ == "MomentumTrackingAdamW" and adopted.second_moment_every == 16
    assert all(a is b for a, b in zip(adopted.param_groups, adamw.param_groups, strict=True))
    group = adopted.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.1, (0.8, 0.9), 1e-6, 0.2)


@pytest.mark.parametrize(
    ("kind", "settings", "named"),
    [
        ("Adam", {"weight_decay": 0.1}, "weight_decay \\(Adam's L2 term\\)"),
        ("AdamW", {"amsgrad": True}, "amsgrad"),
        ("AdamW", {"maximize": True}, "maximize"),
    ],
    ids=["adam-l2", "amsgrad", "maximize"],
)
def test_an_adam_without_a_momentum_tracking_counterpart_is_kept_with_a_warning_naming_why(kind, settings, named):
    from gossip import Pipeline
    from gossip.errors import GossipWarning
    from gossip.integrations.lightning import adopt_adam

    optimizer = _adamw_like(kind, **settings)
    with pytest.warns(GossipWarning, match=f"{kind} with {named}.* trains as returned"):
        assert adopt_adam(optimizer, Pipeline()) is optimizer


def test_other_optimizers_and_a_stepped_adamw_are_returned_as_they_are():
    from gossip import Pipeline
    from gossip.integrations.lightning import adopt_adam

    sgd, adam = _adamw_like("SGD"), _adamw_like("Adam")
    assert adopt_adam(sgd, Pipeline()) is sgd
    assert type(adopt_adam(adam, Pipeline())).__name__ == "MomentumTrackingAdamW"  # Adam without decay is AdamW
    stepped = _adamw_like("AdamW")
    for p in stepped.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    stepped.step()
    assert adopt_adam(stepped, Pipeline()) is stepped  # its moments would be lost
