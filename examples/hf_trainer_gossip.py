"""The HuggingFace Trainer with gossip instead of DDP: ``GossipTrainer`` in ``Trainer``'s place is the one change.

A tiny GPT-2, randomly initialised (nothing is downloaded), learns a synthetic token language; every process
trains its own replica on its own shard with the default pipeline and evaluates the replicas' average:

    torchrun --nproc-per-node 2 examples/hf_trainer_gossip.py            # CPU: Gloo; on GPUs: NCCL
    torchrun --nproc-per-node 2 examples/hf_trainer_gossip.py --out run  # also saves the averaged model to run/

Rank 0 prints the evaluation loss of the average before and after training. Needs
``pip install 'gossip-train[hf]'``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from gossip.integrations.hf import GossipTrainer

VOCAB, LENGTH = 64, 32


def sequences(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Arithmetic progressions of tokens modulo the vocabulary: each sequence's next token is predictable."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count, 1), generator=generator)
    strides = torch.randint(1, 4, (count, 1), generator=generator)
    rows = (starts + strides * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=None, help="save the averaged model here after training")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=LENGTH))
    training = TrainingArguments(
        output_dir=args.out or "hf_gossip_run",
        max_steps=args.steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        learning_rate=3e-3,
        weight_decay=0.1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = GossipTrainer(  # was Trainer
        model=model, args=training, train_dataset=sequences(2048, 0), eval_dataset=sequences(128, 1)
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]  # every rank holds the average now
    if args.out:
        trainer.save_model()  # on every rank, as the Trainer's own saves
    if trainer.is_world_process_zero():
        steps = trainer.state.global_step
        print(f"{training.world_size} processes, {steps} steps: eval loss {before:.4f} -> {after:.4f}")
    if torch.distributed.is_initialized():  # Accelerate's world group: its threads end before the interpreter's
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
