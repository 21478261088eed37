"""gossip.integrations.lightning: Lightning's Trainer with GossipStrategy, 4 CPU devices on Gloo, one job.

tests/helpers/lightning_worker.py runs every scenario in the same 4 processes (its docstring lists them); each test
below pins one property of what they recorded. Skipped without pytorch_lightning (the ``lightning`` extra, which
the ``test`` extra installs). The example (examples/lightning_gossip.py) runs under Lightning's own launcher, and
tests/helpers/lightning_launched_worker.py on 2 processes started by torchrun and by ``mpiexec`` (Lightning's
``TorchElasticEnvironment`` and ``MPIEnvironment``; nothing but Lightning sets up torch.distributed there), and
under torchrun on the unified ``lightning`` package (``import lightning.pytorch as pl``), which the test extra
installs beside ``pytorch_lightning``.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from helpers.launch import CPU_ONLY, REPO, _env, launch, mpiexec, python

pytestmark = pytest.mark.multiprocess

N = 4
STEP = ["forward", "backward", "mix", "update", "start"]  # after the first step's start, each step is this


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("lightning_worker.py", tmp_path_factory.mktemp("lightning"), [], backend="gloo", n=N, timeout=400)[0]


def test_the_strategys_model_is_the_gossip_wrapper_and_no_ddp(ranks):
    assert {(r["pipeline"]["model_type"], r["pipeline"]["ddp_modules"]) for r in ranks} == {
        ("DecentralizedDataParallel", 0)
    }


def test_each_step_runs_forward_backward_then_mixes_then_updates_as_the_plain_loop(ranks):
    for result in ranks:
        events = result["pipeline"]["events"]
        assert events[: 1 + 4 * len(STEP)] == ["start", *STEP * 4]
        assert events == result["plain"]["events"]


def test_the_lightning_run_has_the_plain_loops_losses(ranks):
    for result in ranks:
        assert len(result["pipeline"]["losses"]) == 4
        assert result["pipeline"]["losses"] == pytest.approx(result["plain"]["losses"], rel=1e-6, abs=1e-7)
        assert torch.allclose(result["pipeline"]["final"], result["plain"]["final"], rtol=1e-6, atol=1e-7)


def test_manual_optimization_follows_the_same_trajectory(ranks):
    for result in ranks:
        assert result["manual"]["losses"] == pytest.approx(result["pipeline"]["losses"], rel=1e-6, abs=1e-7)
        assert result["manual"]["events"] == result["pipeline"]["events"]


def test_bf16_mixed_trains_under_autocast_close_to_float32(ranks):
    for result in ranks:
        assert result["bf16"]["dtypes"] == ["torch.bfloat16"]
        assert result["bf16"]["losses"] == pytest.approx(result["pipeline"]["losses"], rel=5e-2, abs=1e-2)


def test_ring_gossip_leaves_the_replicas_different(ranks):
    finals = [r["ring"]["final"] for r in ranks]
    assert all(not torch.allclose(finals[0], other) for other in finals[1:])


def test_a_complete_graph_mixes_every_replica_to_the_same_average(ranks):
    for step in range(2):
        mixed = [r["complete"]["pre_update"][step] for r in ranks]
        assert all(torch.allclose(mixed[0], other, rtol=0, atol=1e-6) for other in mixed[1:])
    assert not torch.allclose(ranks[0]["ring"]["pre_update"][1], ranks[1]["ring"]["pre_update"][1])


def test_validation_on_the_average_is_identical_on_every_rank(ranks):
    losses = [r["ring"]["val_losses"] for r in ranks]
    assert len(losses[0]) == 2 * 4  # 4 batches after steps 2 and 4, while the replicas differ
    assert all(other == losses[0] for other in losses[1:])


def test_two_optimizers_are_refused_by_name_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        assert result["refused"].startswith(f"ConfigurationError: rank {rank}: step 0: GossipStrategy: "), result
        assert "returned 2 optimizers" in result["refused"]


def test_gradient_accumulation_is_one_gossip_step_per_optimizer_step(ranks):
    for result in ranks:
        assert result["accumulate"]["gossip_steps"] == 2
        events = result["accumulate"]["events"]
        assert events[:11] == ["start", *["forward", "backward"] * 2, "mix", "update", "start", "forward", "backward",
                               "forward"]  # fmt: skip


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


def test_no_gossip_or_gloo_thread_is_left_after_fit(ranks):
    for result in ranks:
        threads = result["threads"]
        assert all(after == threads["baseline"] for after in threads["after"].values()), threads


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
LAUNCHES = [("torchrun", "pytorch_lightning"), ("mpiexec", "pytorch_lightning"), ("torchrun", "lightning.pytorch")]


@pytest.fixture(scope="module", params=LAUNCHES, ids=["torchrun", "mpiexec", "torchrun-unified-lightning"])
def launched(request, tmp_path_factory):
    """``(package, environment class, per-rank results)`` of lightning_launched_worker.py on 2 processes."""
    launcher, package = request.param
    out = tmp_path_factory.mktemp(launcher)
    extra = {"GOSSIP_TEST_LIGHTNING": package}
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


def test_under_an_outside_launcher_the_strategy_is_built_on_the_trainers_package(launched):
    """The unified ``lightning`` package's run never imports ``pytorch_lightning``, nor the other way round."""
    package = launched[0]
    for result in launched[2]:
        assert result["package"] == {"asked": package, "chosen": package, "trainer": f"{package}.trainer.trainer",
                                     "strategy_base": f"{package}.strategies.ddp", "loaded": [package]}  # fmt: skip


def test_under_an_outside_launcher_lightning_runs_on_the_launchers_processes(launched):
    _, environment, ranks = launched
    for rank, result in enumerate(ranks):
        assert result["environment"] == {"class": environment, "external": True, "world_size": LAUNCHED,
                                         "rank": rank, "dist_rank": rank}  # fmt: skip


def test_under_an_outside_launcher_the_model_is_the_gossip_wrapper_and_no_ddp(launched):
    for result in launched[2]:
        fit = result["fit"]
        assert (fit["model_type"], fit["ddp_modules"], fit["gossip_steps"]) == ("DecentralizedDataParallel", 0, 4)


def test_under_an_outside_launcher_training_is_the_plain_loops_bit_for_bit(launched):
    """Validation on the average after steps 2 and 4 changes nothing of the trajectory either."""
    for result in launched[2]:
        assert result["fit"]["events"] == result["plain"]["events"]
        assert result["fit"]["events"][: 1 + 4 * len(STEP)] == ["start", *STEP * 4]
        assert result["fit"]["losses"] == result["plain"]["losses"]
        assert torch.equal(result["fit"]["replica"], result["plain"]["final"])


def test_under_an_outside_launcher_validation_is_the_averages_on_every_rank(launched):
    ranks = launched[2]
    replicas = [r["fit"]["replica"] for r in ranks]
    assert not torch.allclose(replicas[0], replicas[1])  # compressed gossip: the replicas differ
    losses = [r["fit"]["val_losses"] for r in ranks]
    assert len(losses[0]) == 2 * 4 and losses[1] == losses[0]  # the same data, the same (averaged) model


def test_under_an_outside_launcher_every_rank_ends_with_the_average_and_no_thread_left(launched):
    ranks = launched[2]
    average = torch.stack([r["fit"]["replica"] for r in ranks]).mean(dim=0)
    for result in ranks:
        assert torch.allclose(result["fit"]["final"], average, rtol=0, atol=1e-7)
        threads = result["threads"]
        assert threads["after"] == threads["baseline"], threads
        assert not any(name.startswith("gossip") for name in threads["baseline"]), threads
