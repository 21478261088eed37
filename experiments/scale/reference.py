"""The same run on the library itself: n virtual ranks of :func:`gossip.simulate` around the real wrapper.

:func:`simulated_trajectory` trains an :class:`~experiments.scale.config.EngineConfig` the way the learning-per-step
study does (``torch.manual_seed(seed)`` then the GPT on every rank, :class:`gossip.app.corpus.ShardedBatches` per
rank, the lr schedule written into the groups each step, ``loss.backward(); optimizer.step()``), with the library
building every part: :class:`gossip.Pipeline` for the default pipeline's combination, otherwise
:class:`gossip.DecentralizedDataParallel` with the configuration's schedule, algorithm, ``gradient_tracking`` and
``mean_gradient``, and :class:`optim.AccumAdamW` or :class:`optim.MomentumTrackingAdamW` over
:func:`optim.param_groups`; DDP as the study's (the gradients all-reduced, AdamW on every rank). It returns every
rank's parameters after every step, the engine's equivalence oracle.
"""

from __future__ import annotations

import threading

import torch

import gossip
import optim
from experiments.scale.config import EngineConfig
from experiments.scale.replicas import template_model
from gossip.app.corpus import ShardedBatches
from gossip.app.train import TrainConfig, learning_rate


def _wrap(config: EngineConfig, module: torch.nn.Module, comm: gossip.Communicator) -> tuple:
    """The wrapper (None for DDP) and the optimizer of one rank."""
    adam = {"lr": config.lr, "betas": (config.beta1, config.beta2)}
    if config.params == "ddp":
        groups = optim.param_groups(module, config.weight_decay)
        return None, optim.AccumAdamW(groups, **adam, eps=1e-8, accum_iter=1)
    if config.is_pipeline():
        pipeline = gossip.Pipeline(
            rank=config.rank,
            power_iterations=config.iterations,
            message_dtype=getattr(torch, config.message_dtype) if config.message_dtype else None,
            tracker_hops=config.tracker_hops,
            second_moment=config.second_moment,
            second_moment_every=config.second_moment_every,
            mean_gradient=config.mean_gradient,
            mean_gradient_dtype=config.sample_dtype(),
            schedule=config.schedule or None,
        )
        return pipeline.wrap(module, comm, **adam, weight_decay=config.weight_decay, seed=config.seed)
    algorithm = config.powergossip() if config.params == "powergossip" else gossip.ExactGossip(config.gamma)
    wrapped = gossip.DecentralizedDataParallel(
        module,
        comm,
        config.build_schedule(),
        algorithm,
        seed=config.seed,
        gradient_tracking=config.tracking(),
        tracker_hops=config.tracker_hops,
        mean_gradient=config.mean_gradient,
        mean_gradient_dtype=config.sample_dtype(),
    )
    groups = optim.param_groups(module, config.weight_decay)
    if config.optimizer == "momentum-tracking":
        every, second = config.sampling_every(), config.second_moment
        return wrapped, optim.MomentumTrackingAdamW(
            groups, **adam, eps=1e-8, second_moment=second, second_moment_every=every
        )
    return wrapped, optim.AccumAdamW(groups, **adam, eps=1e-8, accum_iter=1)


def simulated_trajectory(config: EngineConfig, train: torch.Tensor, steps: int, device: str = "cpu") -> list[dict]:
    """Train ``steps`` steps of ``config`` on the simulator; every rank's parameters after each step.

    Args:
        config: the run.
        train: the training bytes.
        steps: the steps to train (the lr schedule keeps ``config.steps``).
        device: the ranks' device.

    Returns:
        One dict per step: ``"params"``, (n, P) float32 (each rank's trainable parameters, concatenated in order),
            ``"losses"``, (n,), and ``"bytes"``, the payload bytes each rank's algorithm counted for steps 0 ... t,
            (n,) (0 for DDP, which runs no wrapper).
    """
    lock = threading.Lock()
    schedule = TrainConfig(lr=config.lr, steps=config.steps, warmup_steps=config.warmup_steps())

    def worker(comm: gossip.Communicator) -> list[tuple[torch.Tensor, float, int]]:
        with lock:  # the virtual ranks share torch's global generator: seed and build atomically
            module = template_model(config.gpt(), config.seed, torch.device(device))
        wrapped, optimizer = _wrap(config, module, comm)
        batches = ShardedBatches(train, comm.rank, comm.size, config.batch, config.block_size, config.seed, "iid")
        trainable = [p for p in module.parameters() if p.requires_grad]
        records = []
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(schedule, step)
            x, y = (t.to(device) for t in batches.batch(step))
            _, loss = (module if wrapped is None else wrapped)(x, y)
            loss.backward()
            if wrapped is None:  # DDP: the study's all-reduce of the concatenated gradients
                flat = torch.cat([p.grad.reshape(-1) for p in trainable])
                comm.all_reduce(flat, "avg")
                for p, part in zip(trainable, flat.split([p.numel() for p in trainable]), strict=True):
                    p.grad.copy_(part.view_as(p))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sent = 0
            if wrapped is not None:  # step t + 1's first exchange is posted already: its bytes are the last step's
                traffic = wrapped.algorithm.traffic
                sent = traffic.total_sent - sum(traffic.last_sent.values())
            params = torch.cat([p.detach().reshape(-1) for p in trainable]).cpu()
            records.append((params, float(loss.detach()), sent))
        if wrapped is not None:
            wrapped.close()
        return records

    per_rank = gossip.simulate(config.workers, worker, timeout=600.0, device=device)
    return [
        {
            "params": torch.stack([rank[step][0] for rank in per_rank]),
            "losses": torch.tensor([rank[step][1] for rank in per_rank]),
            "bytes": torch.tensor([rank[step][2] for rank in per_rank], dtype=torch.float64),
        }
        for step in range(steps)
    ]
