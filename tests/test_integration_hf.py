"""gossip.integrations.hf: the HF Trainer with GossipTrainer on 2 CPU processes, and the Accelerate recipe of
docs/guide/huggingface.md.

tests/helpers/hf_worker.py runs every scenario in one job, started twice: by ``torchrun --nproc-per-node 2`` and by
``accelerate launch --cpu --num_processes 2`` (Accelerate's multi-CPU launcher: ``mpirun`` of the MPICH wheel with
a one-host hostfile); its docstring lists the scenarios, each test below pins one property of what it recorded,
under both launchers. The refusals run in this process, the example (examples/hf_trainer_gossip.py) under
torchrun. Skipped without transformers and Accelerate (the ``hf`` extra, which the ``test`` extra installs with
the MPICH wheel).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.launch import CPU_ONLY, REPO, _env, mpiexec, python

from gossip.errors import ConfigurationError

N = 2
STEP = ["forward", "backward", "mix", "update", "start"]  # after the first step's start, each step is this


@pytest.fixture(scope="module", params=["torchrun", "accelerate"])
def ranks(request, tmp_path_factory):
    """The worker's per-rank results under ``torchrun --nproc-per-node 2`` and under ``accelerate launch --cpu
    --num_processes 2`` (Accelerate finds the ``mpirun`` it starts the processes with on PATH: the MPICH wheel's,
    beside this interpreter); every test below holds under both."""
    out = tmp_path_factory.mktemp(f"hf-{request.param}")
    worker = str(REPO / "tests" / "helpers" / "hf_worker.py")
    if request.param == "torchrun":
        command = [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={N}", worker, str(out)]
        env = CPU_ONLY
    else:
        hosts = out / "hosts"
        hosts.write_text("localhost\n")
        command = [python(), "-m", "accelerate.commands.launch", "--cpu", f"--num_processes={N}", "--num_machines=1",
                   f"--mpirun_hostfile={hosts}", "--mixed_precision=no", "--dynamo_backend=no", worker,
                   str(out)]  # fmt: skip
        env = {**CPU_ONLY, "PATH": os.pathsep.join((str(Path(mpiexec()).parent), os.environ.get("PATH", "")))}
    job = subprocess.run(command, cwd=out, env=_env(env), capture_output=True, text=True, timeout=400)
    assert job.returncode == 0, job.stdout[-5000:] + job.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)]


@pytest.mark.multiprocess
def test_the_launcher_started_both_processes_as_accelerates_multi_cpu(ranks):
    assert [r["launch"] for r in ranks] == [{"rank": r, "world_size": N, "distributed_type": "MULTI_CPU"}
                                            for r in range(N)]  # fmt: skip


@pytest.mark.multiprocess
def test_the_trainer_wraps_the_model_with_gossip_not_ddp_and_keeps_the_model_itself(ranks):
    assert {r["pipeline"]["models"] for r in ranks} == {("GPT2LMHeadModel", "DecentralizedDataParallel", 0)}


@pytest.mark.multiprocess
def test_dataset_columns_are_filtered_on_the_models_real_forward(ranks):
    for result in ranks:
        keys = result["pipeline"]["forward_keys"]
        assert {"input_ids", "labels"} <= set(keys) and "note" not in keys, keys


@pytest.mark.multiprocess
def test_each_step_runs_forward_backward_then_mixes_then_updates(ranks):
    for result in ranks:
        assert result["pipeline"]["events"][: 1 + 4 * len(STEP)] == ["start", *STEP * 4]
        assert result["pipeline"]["gossip_steps"] == result["pipeline"]["global_step"] == 4


@pytest.mark.multiprocess
def test_compressed_gossip_leaves_the_replicas_different_until_the_average_at_the_end(ranks):
    before = [r["pipeline"]["pre_update"][-1] for r in ranks]
    assert not torch.allclose(before[0], before[1])
    assert torch.equal(ranks[0]["pipeline"]["final"], ranks[1]["pipeline"]["final"])


@pytest.mark.multiprocess
def test_a_complete_graph_mixes_every_replica_to_the_same_average(ranks):
    for step in range(2):
        mixed = [r["complete"]["pre_update"][step] for r in ranks]
        assert torch.allclose(mixed[0], mixed[1], rtol=0, atol=1e-6)


@pytest.mark.multiprocess
def test_evaluate_is_the_averaged_models_loss_on_every_rank(ranks):
    evaluations = [r["pipeline"]["evaluations"] for r in ranks]
    assert len(evaluations[0]) == 2 and evaluations[0] == evaluations[1]  # at steps 2 and 4
    after = [r["pipeline"]["after"] for r in ranks]  # after train(): the model is the average of step 4's replicas
    assert after[0] == after[1] == pytest.approx(evaluations[0][-1], rel=1e-5)


@pytest.mark.multiprocess
def test_evaluate_and_save_model_during_training_never_start_an_exchange(ranks):
    """From the end of steps 2 and 4 to the end of the evaluation after each (with step 2's ``save_model()`` in
    between), the wrapper's step count and its communicator's exchanged bytes stay put."""
    for result in ranks:
        accounts = result["pipeline"]["accounts"]
        evaluated = [i for i, (when, *_) in enumerate(accounts) if when == "evaluated"]
        assert [accounts[i][1] for i in evaluated] == [2, 4], accounts
        for i in evaluated:
            assert accounts[i - 1][0] == "step end" and accounts[i - 1][1:] == accounts[i][1:], accounts
            assert accounts[i][2] > 0


@pytest.mark.multiprocess
def test_save_model_during_training_writes_the_average_of_the_replicas(ranks):
    """``save_model()`` after step 2, called on every rank; rank 0 wrote the file, every rank read it back."""
    replicas = [r["pipeline"]["replica_at_save"] for r in ranks]
    saved = ranks[0]["pipeline"]["saved"]
    assert set(saved) <= set(replicas[0]) and "transformer.h.0.attn.c_attn.weight" in saved
    name = "transformer.h.0.attn.c_attn.weight"
    assert not torch.allclose(replicas[0][name], replicas[1][name])
    for name, value in saved.items():
        average = (replicas[0][name] + replicas[1][name]) / 2
        assert torch.allclose(value, average, rtol=0, atol=1e-6), name
        assert torch.equal(ranks[1]["pipeline"]["saved"][name], value)


@pytest.mark.multiprocess
def test_bf16_on_cpu_trains_under_autocast_with_float32_parameters_close_to_float32(ranks):
    for result in ranks:
        bf16 = result["bf16"]
        assert (bf16["dtypes"], bf16["parameters"]) == (["torch.bfloat16"], ["torch.float32"])
        assert len(bf16["losses"]) == 4
        assert bf16["losses"] == pytest.approx(result["pipeline"]["losses"], rel=5e-2)


@pytest.mark.multiprocess
def test_gradient_accumulation_is_one_gossip_step_per_optimizer_step(ranks):
    """With ``optimizer_cls_and_kwargs``: the optimizer is created after wrapping, of the class asked for."""
    for result in ranks:
        assert result["accumulate"]["optimizer"] == "SGD"
        assert result["accumulate"]["gossip_steps"] == 2
        assert result["accumulate"]["events"][:8] == ["start", *["forward", "backward"] * 2, "mix", "update", "start"]


@pytest.mark.multiprocess
def test_gradient_accumulation_with_the_pipeline_optimizer_is_one_momentum_step_per_optimizer_step(ranks):
    for result in ranks:
        accumulate = result["accumulate_pipeline"]
        assert (accumulate["optimizer"], accumulate["gossip_steps"], accumulate["tracking_step"]) == (
            "MomentumTrackingAdamW",
            2,
            2,
        )
        assert accumulate["events"][:8] == ["start", *["forward", "backward"] * 2, "mix", "update", "start"]


@pytest.mark.multiprocess
def test_local_evaluation_is_of_the_replicas_not_of_their_average(ranks):
    """``gossip_evaluate="local"``: each rank evaluates its shard of the evaluation set with its own replica, the
    Trainer gathers the losses (one metric on every rank); after ``train()`` the model is the average of those
    replicas, whose loss differs."""
    local = [r["accumulate"]["evaluations"] for r in ranks]
    after = [r["accumulate"]["after"] for r in ranks]
    assert len(local[0]) == 1 and local[0] == local[1] and after[0] == after[1]
    assert local[0][0] != pytest.approx(after[0], rel=1e-5)


@pytest.mark.multiprocess
def test_a_checkpoint_holds_the_average_and_each_ranks_state_and_resume_is_bit_identical(ranks):
    files = set(ranks[0]["resume"]["files"])
    assert {"model.safetensors", "gossip/rank0.pt", "gossip/rank1.pt"} <= files, files
    for result in ranks:
        assert torch.equal(result["resume"]["resumed"], result["resume"]["straight"])


@pytest.mark.multiprocess
def test_the_accelerate_recipe_trains_without_ddp_and_evaluates_one_average(ranks):
    recipes = [r["accelerate"] for r in ranks]
    assert all(recipe["prepared"] == [] for recipe in recipes)  # Accelerate never prepared (wrapped) the model
    assert not torch.allclose(recipes[0]["replica"], recipes[1]["replica"])  # compressed gossip: replicas differ
    assert recipes[0]["average_loss"] == recipes[1]["average_loss"]
    for recipe in recipes:
        losses = recipe["losses"]
        assert len(losses) == 8 and recipe["average_loss"] < losses[0]


@pytest.mark.multiprocess
def test_the_accelerate_recipe_steps_a_momentum_tracking_optimizer_through_accelerates_wrapper(ranks):
    """``AcceleratedOptimizer.step()`` calls ``MomentumTrackingAdamW.step(None)``, which refuses a closure: None is
    none. With ``gradient_accumulation_steps=2``, 8 batches are 4 optimizer steps and 4 gossip steps."""
    for recipe in ranks:
        recipe = recipe["accelerate"]
        assert recipe["optimizer"] == ("AcceleratedOptimizer", "MomentumTrackingAdamW")
        assert recipe["optimizer_steps"] == recipe["gossip_steps"] == 4


@pytest.mark.multiprocess
def test_no_gossip_or_gloo_thread_is_left_after_train(ranks):
    for result in ranks:
        threads = result["threads"]
        assert all(after == threads["baseline"] for after in threads["after"].values()), threads


def _tiny_trainer(tmp_path, **arguments):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from gossip.integrations.hf import GossipTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **arguments)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    return lambda **extra: GossipTrainer(model=model, args=args, **extra)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"fp16": True}, "fp16=True"),
        ({"fsdp": True}, "fsdp"),
        ({"fsdp": True, "fsdp_config": {"min_num_params": 0, "cpu_ram_efficient_loading": False}}, "fsdp"),
        ({"torch_compile": True}, "torch_compile=True"),
    ],
    ids=["fp16", "fsdp", "fsdp-config", "torch-compile"],
)
def test_unsupported_settings_are_refused_by_name(tmp_path, arguments, named):
    with pytest.raises(ConfigurationError, match=f"GossipTrainer does not support {named}"):
        _tiny_trainer(tmp_path, **arguments)()


def test_a_deepspeed_config_in_the_arguments_is_refused_by_name_before_the_trainer_reads_it(tmp_path):
    """Without deepspeed installed, ``TrainingArguments(deepspeed=...)`` itself raises (transformers requires
    deepspeed>=0.9.3 there), so the config is set on built arguments: the attribute the Trainer would read."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from gossip.integrations.hf import GossipTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.deepspeed = {"train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    with pytest.raises(ConfigurationError, match="GossipTrainer does not support deepspeed: DeepSpeed's engine"):
        GossipTrainer(model=model, args=args)


def test_a_ready_made_optimizer_is_refused_for_optimizer_cls_and_kwargs(tmp_path):
    make = _tiny_trainer(tmp_path)
    with pytest.raises(ConfigurationError, match="optimizer_cls_and_kwargs"):
        make(optimizers=(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), None))


@pytest.mark.multiprocess
def test_the_example_trains_under_torchrun(tmp_path):
    command = [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={N}",
               str(REPO / "examples" / "hf_trainer_gossip.py"), "--steps", "20"]  # fmt: skip
    job = subprocess.run(command, cwd=tmp_path, env=_env(CPU_ONLY), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-5000:] + job.stderr[-5000:]
    found = re.search(r"2 processes, 20 steps: eval loss ([\d.]+) -> ([\d.]+)", job.stdout)
    assert found is not None, job.stdout[-3000:]
    assert float(found.group(2)) < float(found.group(1))
