"""Worker for tests/test_integration_hf.py: the HF Trainer with GossipTrainer on 2 CPU processes (Gloo).

Usage: ``accelerate launch --cpu --num_processes 2 --mpirun_hostfile HOSTS tests/helpers/hf_worker.py OUT_DIR``
(or ``torchrun --nproc-per-node 2 tests/helpers/hf_worker.py OUT_DIR``)

A tiny randomly initialised GPT-2 (no download) on synthetic token data with an extra dataset column (``note``)
that its ``forward`` does not take. Each scenario is one ``train()``; the worker writes ``rank<r>.pt``:

* ``pipeline``: the default pipeline, 4 steps, ``evaluate()`` every 2 steps: the trainer's models, the keyword
  arguments the model's forward received, the step events, the parameters before each update, the evaluations,
  the training losses, the parameters after ``train()`` and an ``evaluate()`` after it; after step 2, this rank's
  replica and a ``save_model()`` called on every rank (what rank 0 wrote, read back on every rank); the wrapper's
  step count and exchanged bytes at the end of each step and after each evaluation.
* ``bf16``: the pipeline scenario with ``bf16=True`` (``use_cpu=True``): the dtype of ``lm_head``'s output inside
  the forward, of the parameters, the training losses.
* ``complete``: exact gossip on the complete graph: the mixed parameters before each update.
* ``accumulate``: ``gradient_accumulation_steps=2``, ``optimizer_cls_and_kwargs`` (SGD) and
  ``gossip_evaluate="local"`` with ``evaluate()`` at the last step: gossip steps, forwards, the optimizer's class,
  that evaluation and an ``evaluate()`` after ``train()``.
* ``accumulate_pipeline``: ``gradient_accumulation_steps=2`` with the trainer's own optimizer (the pipeline's): gossip
  steps, forwards, the optimizer's class, its tracking step count.
* ``resume``: 4 steps with a checkpoint at step 2, then ``train(resume_from_checkpoint=...)`` from it.
* ``accelerate``: the Accelerate recipe of docs/guide/huggingface.md, run as printed.
* ``threads``: after each ``train()``, the gossip and Gloo threads compared with those before the first.

tests/test_integration_hf.py runs it under ``torchrun --nproc-per-node 2`` and under ``accelerate launch --cpu
--num_processes 2`` (Accelerate's multi-CPU launcher, which starts the processes with ``mpirun``; the MPICH wheel's
here); nothing in it depends on the launcher.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import SequentialSampler
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import gossip
import topologies
from gossip.integrations.hf import GossipTrainer
from helpers.gloo_threads import gossip_and_gloo_threads

REPO = Path(__file__).resolve().parent.parent.parent
N, BATCH, LENGTH = 2, 4, 16


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=LENGTH))


def tokens(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 64, (count, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row, "note": torch.tensor(i)} for i, row in enumerate(rows)]


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class SequentialTrainer(GossipTrainer):
    """Batches in dataset order, so that a resumed run's data does not depend on the RNG streams."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class Spy(TrainerCallback):
    """Records the trainer's models, the step events and the parameters before each update."""

    def __init__(self, save_at: int | None = None, save_dir: Path | None = None):
        self.trainer = None
        self.save_at, self.save_dir = save_at, save_dir
        self.replica_at_save: dict[str, torch.Tensor] = {}
        self.dtypes: set[str] = set()
        self.events: list[str] = []
        self.pre_update: list[torch.Tensor] = []
        self.forward_keys: set[str] = set()
        self.models: tuple[str, str, int] | None = None
        self.gossip_steps = -1
        self.global_step = -1
        self.accounts: list[tuple[str, int, int, int]] = []  # (when, step count, bytes sent, bytes received)

    def _account(self, when: str) -> None:
        wrapper = self.trainer.gossip_model
        sent, received = sum(wrapper.comm.bytes_sent.values()), sum(wrapper.comm.bytes_received.values())
        self.accounts.append((when, wrapper.step_count, sent, received))

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, model = self.trainer, self.trainer.model
        wrapper = trainer.model_wrapped
        self.models = (type(model).__name__, type(wrapper).__name__,
                       sum(isinstance(m, nn.parallel.DistributedDataParallel) for m in wrapper.modules()))  # fmt: skip
        algorithm, events = wrapper.algorithm, self.events
        start, finish = algorithm.start, algorithm.finish
        algorithm.start = lambda step: (events.append("start"), start(step))[1]
        algorithm.finish = lambda pending: (events.append("mix"), finish(pending))[1]

        def forward(module, args, kwargs):
            if module.training:
                events.append("forward")
                self.forward_keys.update(kwargs)

        def update(*_):
            events.append("update")
            self.pre_update.append(flat(model))

        def output(module, args, result):  # Accelerate's autocast forward returns the logits in float32
            if module.training:
                self.dtypes.add(str(result.dtype))

        model.register_forward_pre_hook(forward, with_kwargs=True)
        model.lm_head.register_forward_hook(output)
        model.transformer.wpe.weight.register_post_accumulate_grad_hook(lambda _: events.append("backward"))
        trainer._torch_optimizer().register_step_pre_hook(update)

    def on_step_end(self, args, state, control, **kwargs):
        self._account("step end")  # the Trainer evaluates after this hook
        if state.global_step == self.save_at:  # a collective: every rank calls it, as a user's code would
            self.replica_at_save = {n: v.detach().clone() for n, v in self.trainer.model.state_dict().items()}
            self.trainer.save_model(str(self.save_dir))

    def on_evaluate(self, args, state, control, **kwargs):
        if self.trainer.gossip_model is not None:
            self._account("evaluated")

    def on_train_end(self, args, state, control, **kwargs):
        self.gossip_steps, self.global_step = self.trainer.gossip_model.step_count, state.global_step


def arguments(out: Path, name: str, **overrides) -> TrainingArguments:
    settings = {"output_dir": str(out / name), "use_cpu": True, "report_to": [], "per_device_train_batch_size": BATCH,
                "per_device_eval_batch_size": BATCH, "max_steps": 4, "learning_rate": 3e-3, "save_strategy": "no",
                "logging_steps": 1, "disable_tqdm": True, "seed": 0, "optim": "adamw_torch", **overrides}  # fmt: skip
    return TrainingArguments(**settings)


def train(trainer_class, args: TrainingArguments, resume: str | None = None, spy: Spy | None = None,
          **gossip_options):  # fmt: skip
    spy = Spy() if spy is None else spy
    trainer = trainer_class(model=tiny_gpt2(), args=args, train_dataset=tokens(32, 1), eval_dataset=tokens(8, 2),
                            callbacks=[spy], **gossip_options)  # fmt: skip
    spy.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, spy


def losses(trainer) -> list[float]:
    """The training loss of every step (``logging_steps=1``), as the Trainer logged it."""
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def eval_losses(trainer) -> list[float]:
    """The loss of every evaluation during ``train()``, as the Trainer logged it."""
    return [row["eval_loss"] for row in trainer.state.log_history if "eval_loss" in row]


def complete_wrap(module, comm):
    return gossip.DecentralizedDataParallel(module, comm, topologies.complete(comm.size), gossip.ExactGossip())


def accelerate_recipe() -> dict:
    """The guide's Accelerate loop, run as printed; what it leaves in its namespace."""
    guide = (REPO / "docs" / "guide" / "huggingface.md").read_text()
    code = re.search(r"<!-- accelerate recipe -->\n```python\n(.*?)```", guide, re.DOTALL).group(1)
    namespace: dict = {"__name__": "recipe"}
    exec(compile(code, "huggingface.md (Accelerate recipe)", "exec"), namespace)
    model, optimizer = namespace["model"], namespace["optimizer"]
    return {"losses": namespace["losses"], "average_loss": namespace["average_loss"],
            "prepared": [type(p).__name__ for p in namespace["accelerator"]._models],
            "optimizer": (type(optimizer).__name__, type(optimizer.optimizer).__name__),
            "gossip_steps": model.step_count, "optimizer_steps": namespace["optimizer_steps"],
            "replica": flat(model.module)}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    args = arguments(out, "pipeline", eval_strategy="steps", eval_steps=2)
    rank = args.process_index  # the arguments initialise torch.distributed under torchrun
    dist.barrier()
    time.sleep(0.5)
    baseline = gossip_and_gloo_threads()
    threads, result = {}, {}
    result["launch"] = {"rank": rank, "world_size": dist.get_world_size(),
                        "distributed_type": args.distributed_state.distributed_type.name}  # fmt: skip

    saved = out / "pipeline-saved"
    trainer, spy = train(GossipTrainer, args, spy=Spy(save_at=2, save_dir=saved))
    evaluations = eval_losses(trainer)
    result["pipeline"] = {"models": spy.models, "forward_keys": sorted(spy.forward_keys), "events": spy.events,
                          "pre_update": spy.pre_update, "evaluations": evaluations, "final": flat(trainer.model),
                          "after": trainer.evaluate()["eval_loss"], "gossip_steps": spy.gossip_steps,
                          "global_step": spy.global_step, "losses": losses(trainer),
                          "replica_at_save": spy.replica_at_save, "accounts": spy.accounts,
                          "saved": load_file(saved / "model.safetensors")}  # fmt: skip
    threads["pipeline"] = gossip_and_gloo_threads(baseline)

    trainer, spy = train(GossipTrainer, arguments(out, "bf16", bf16=True))
    result["bf16"] = {"dtypes": sorted(spy.dtypes), "losses": losses(trainer),
                      "parameters": sorted({str(p.dtype) for p in trainer.model.parameters()})}  # fmt: skip

    trainer, spy = train(GossipTrainer, arguments(out, "complete", max_steps=2), gossip_wrap=complete_wrap)
    result["complete"] = {"pre_update": spy.pre_update}

    accumulate = arguments(out, "accumulate", max_steps=2, gradient_accumulation_steps=2, eval_strategy="steps",
                           eval_steps=2)  # fmt: skip
    trainer, spy = train(GossipTrainer, accumulate, gossip_evaluate="local",
                         optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))  # fmt: skip
    result["accumulate"] = {"gossip_steps": spy.gossip_steps, "events": spy.events,
                            "optimizer": type(trainer._torch_optimizer()).__name__,
                            "evaluations": eval_losses(trainer),
                            "after": trainer.evaluate()["eval_loss"]}  # fmt: skip

    trainer, spy = train(GossipTrainer, arguments(out, "accumulate_pipeline", max_steps=2,
                                                  gradient_accumulation_steps=2))  # fmt: skip
    optimizer = trainer._torch_optimizer()
    result["accumulate_pipeline"] = {"gossip_steps": spy.gossip_steps, "events": spy.events,
                                     "optimizer": type(optimizer).__name__,
                                     "tracking_step": optimizer.param_groups[0]["tracking_step"]}  # fmt: skip

    saving = {"save_strategy": "steps", "save_steps": 2}
    trainer, _ = train(SequentialTrainer, arguments(out, "resume", **saving))
    straight = flat(trainer.model)
    checkpoint = out / "resume" / "checkpoint-2"
    trainer, _ = train(SequentialTrainer, arguments(out, "resume", **saving), resume=str(checkpoint))
    result["resume"] = {"straight": straight, "resumed": flat(trainer.model),
                        "files": sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*"))}  # fmt: skip
    threads["resume"] = gossip_and_gloo_threads(baseline)

    result["accelerate"] = accelerate_recipe()
    threads["accelerate"] = gossip_and_gloo_threads(baseline)
    result["threads"] = {"baseline": baseline, "after": threads}
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
