r"""What gradient tracking gives each rank's AdamW: the noise of its tracker and of its moments, against plain gossip.

With the one-peer hypercube at n = 8 the product of three consecutive mixing matrices is the exact average J,
so the tracker :math:`y_i^t = \sum_j W_{ij}(t)(y_j^{t-1} + g_j^t - g_j^{t-1})` deviates from the mean gradient by
:math:`e^t = P_1\xi^t - (P_1 - P_2)\xi^{t-1} - P_2\xi^{t-2}` (:math:`\xi` the ranks' gradient deviations from the
mean, :math:`P_1 = W(t)`, :math:`P_2 = W(t)W(t-1)` restricted to deviations): six of the seven deviation
directions of the current and two previous gradients, so the tracker is about as far from the mean gradient as a
rank's own gradient is, while the coefficients of every :math:`\xi^k` sum to zero over the steps, so that an
average over time -- Adam's first moment -- cancels most of it. This script measures both on the study's task
(``exact`` gossip with and without ``gradient_tracking``, n = 8 of 8 sequences, seed 0): per step, averaged over
the ranks, the squared distance of the rank's gradient g_i, of what its optimizer steps on (``.grad``: g_i, or
y_i with tracking) and of its first moment m_i to their means over the ranks, relative to the squared norm of
those means; and the size of its second moment v_i against the second moment DDP's AdamW would hold, the same
EMA of the squared mean gradient :math:`\bar g^2` (ratio of the sums over coordinates: 1 under DDP).

``python -m experiments.learning_per_step.tracker_noise --steps 300 --from-step 100`` prints one Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading

import torch

import gossip
from experiments.learning_per_step.study import RunConfig, make_algorithm, make_optimizer, make_schedule
from gossip.app.corpus import ShardedBatches, load_corpus
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import TrainConfig, learning_rate

KEYS = ("gradient", "stepped_on", "m", "v_over_ddp")


def _spread(flat: torch.Tensor, comm: gossip.Communicator) -> float:
    """mean_i ||x_i - x̄||² / ||x̄||² over the ranks (a collective)."""
    mean = flat.double().clone()
    comm.all_reduce(mean, "avg")
    deviation = torch.tensor([float((flat.double() - mean).square().sum())], dtype=torch.float64)
    comm.all_reduce(deviation, "avg")
    return float(deviation) / float(mean.square().sum())


def relative_spreads(config: RunConfig, seed: int, from_step: int) -> dict[str, float]:
    """Train ``config`` with ``seed``; return the mean over steps >= ``from_step`` of each relative spread.

    Args:
        config: the configuration (the study's harness order: forward, backward, ``optimizer.step()``).
        seed: the run's seed.
        from_step: the first step averaged.

    Returns:
        ``{"gradient", "stepped_on", "m"}`` -> mean relative spread over the ranks; ``"v_over_ddp"`` -> mean of
        sum(v_i) / sum(EMA of the squared mean gradient).
    """
    model_config = GPTConfig()
    corpus = load_corpus(None, block_size=model_config.block_size)
    schedule_config = TrainConfig(lr=config.lr, steps=config.steps, warmup_steps=config.warmup)
    init_lock = threading.Lock()

    def worker(comm: gossip.Communicator) -> dict[str, float]:
        with init_lock:
            torch.manual_seed(seed)
            module = GPT(model_config)
        wrapped = gossip.DecentralizedDataParallel(
            module, comm, make_schedule(config), make_algorithm(config), seed=seed,
            gradient_tracking=config.gradient_tracking,
        )  # fmt: skip
        optimizer = make_optimizer(config, module)
        batches = ShardedBatches(corpus.train, comm.rank, comm.size, config.batch, model_config.block_size, seed, "iid")
        parameters = list(module.parameters())
        records: dict[str, list[float]] = {key: [] for key in KEYS}
        beta2 = config.beta2
        ddp_v = torch.zeros(sum(p.numel() for p in parameters), dtype=torch.float64)
        for step in range(config.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(schedule_config, step)
            x, y = batches.batch(step)
            wrapped(x, y)[1].backward()
            gradient = torch.cat([p.grad.reshape(-1) for p in parameters]).clone()
            mean_gradient = gradient.double()
            comm.all_reduce(mean_gradient, "avg")
            ddp_v.mul_(beta2).add_(mean_gradient.square(), alpha=1 - beta2)
            optimizer.step()
            if step >= from_step:
                stepped_on = torch.cat([p.grad.reshape(-1) for p in parameters])
                states = [optimizer.state[p] for p in parameters]
                m = torch.cat([s["beta1_exp_avg"].reshape(-1) for s in states])
                v = torch.cat([s["beta2_exp_avg_sq"].reshape(-1) for s in states])
                for key, flat in zip(KEYS, (gradient, stepped_on, m), strict=False):
                    records[key].append(_spread(flat, comm))
                ratio = torch.tensor([float(v.double().sum() / ddp_v.sum())], dtype=torch.float64)
                comm.all_reduce(ratio, "avg")
                records["v_over_ddp"].append(float(ratio))
            optimizer.zero_grad(set_to_none=True)
        wrapped.close()
        return {key: statistics.fmean(values) for key, values in records.items()}

    return gossip.simulate(config.workers, worker, timeout=1800.0)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of the run (lr schedule of that length)")
    parser.add_argument("--from-step", type=int, default=100, help="first step averaged")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = RunConfig("exact", algorithm="exact", steps=args.steps)
    print("| configuration | spread of g_i | of what AdamW steps on | of m_i | v_i / v of the mean gradient |")
    print("|---|---:|---:|---:|---:|")
    for config in (base, dataclasses.replace(base, name="exact-gt", gradient_tracking=True)):
        spreads = relative_spreads(config, args.seed, args.from_step)
        print(f"| `{config.name}` | " + " | ".join(f"{spreads[key]:.3f}" for key in KEYS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
