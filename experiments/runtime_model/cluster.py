r"""Predicted time to DDP's final loss at cluster scale: DDP, the default pipeline and DiLoCo (issue 60, item 3).

Time to a loss is steps times seconds per step. Seconds per step come from the runtime model
(:mod:`experiments.runtime_model.costs`, :mod:`experiments.runtime_model.model`) on a flat network, one GPU per
network port of ``bandwidth`` bytes/s and latency alpha, for a GPT-2-small-sized model (:func:`gpt2_shapes`, P
parameters, fp32 messages where the library sends fp32). Steps are DDP's steps S to its final loss times a *steps
ratio* rho (the method's steps to DDP's final loss over DDP's), an input: the runtime model does not know how a
method learns. So the prediction is

.. math::  \frac{T_{method}}{T_{DDP}} = \rho \, \frac{t_{method}}{t_{DDP}},

with t the predicted seconds per step; S cancels. Per step, with compute C (forward + backward, no variance), M =
4 P bytes:

* DDP (:func:`ddp_step`): a bucketed all-reduce overlapped with half of the backward (2/3 of C), as the runtime
  model's ``allreduce_iteration`` (docs/design.md B.5): t = C + max(0, T_AR - C/3), T_AR = ``allreduce_cost`` of M
  over n ranks (the ring, 2 (n-1) alpha + 2 (n-1)/n M / B, Patarasuk & Yuan 2009, or for a power of two the faster
  halving-doubling, Thakur et al. 2005).
* The default pipeline (:func:`default_step`, ``gossip.Pipeline()``): on the one-peer hypercube the parameters'
  PowerGossip (Vogels et al. 2020, Sec. 3: rank r, q power iterations, each one dependent exchange of the factors
  in float16, ``topologies.bytes_per_step``) overlaps forward and backward; every K = 64 steps the mean gradient's
  sample travels log2 n hops of M, one a step, posted with the parameters' exchange (``gossip.wrapper
  .mean_gradient``); the trackers' k scaled-sign messages (CHOCO-Gossip, Koloskova et al. 2019; 1 + log2 levels
  bits a value and one float32 scale per level and chunk; k = ``tracker_hops``, one after the other) are sent after
  the backward (adapt-then-combine, Takezawa et al. 2023, ``tracking_overlap=False``) and are not hidden:
  t = mean over one period of [C + max(0, q alpha + (B_pg + h_t M) / B - C)] + k (alpha + B_sign / B), h_t = 1 on
  the log2 n hop steps, else 0.
* DiLoCo (:func:`diloco_step`, Douillard et al. 2023, Sec. 2): H local AdamW steps, then an all-reduce of the
  model's change, blocking: t = C + T_AR / H.

Not modelled: compute variance and stragglers (``compute_cv`` = 0), the cost of encoding (factors, signs) on the
GPU, the optimizer's own time, several GPUs sharing one port (``Network.local_size`` = 1), congestion.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence

import gossip
import topologies
from experiments.rates import parse_rate
from experiments.runtime_model.costs import RuntimeModelError, allreduce_cost
from experiments.runtime_model.model import allreduce_iteration, gossip_iteration
from experiments.scale.sign import message_bytes as sign_message_bytes

#: GPT-2 small (Radford et al. 2019): vocabulary, context, blocks, width; the output layer tied to the embedding.
GPT2_SMALL = (50257, 1024, 12, 768)


def gpt2_shapes(vocab: int, context: int, layers: int, width: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a GPT-2 (token and position embeddings, per block two layer norms, the attention's
    qkv and output projections and the 4x MLP with biases, a final layer norm; tied output).

    Args:
        vocab: vocabulary size.
        context: positions.
        layers: blocks.
        width: the model width.

    Returns:
        One shape per tensor (GPT-2 small: 124,439,808 parameters).
    """
    block = [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
             (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]  # fmt: skip
    return [(vocab, width), (context, width), *block * layers, (width,), (width,)]


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model and the settings the step times depend on (defaults: ``gossip.Pipeline()``'s).

    Attributes:
        shapes: the parameter shapes.
        compute_s: forward + backward of one worker's batch, seconds.
        rank: PowerGossip's rank.
        iterations: PowerGossip's power iterations per step.
        factor_bytes: bytes per element of PowerGossip's messages (2: float16).
        second_moment_every: K, steps between two samples of the mean gradient.
        sign_chunk: ChocoSign's values per scale.
        sign_levels: ChocoSign's magnitudes per chunk.
        tracker_hops: k, the trackers' messages a step; None: the default pipeline's for n
            (:func:`gossip.default_tracker_hops`, 3 at n = 64, 4 at 256, 5 at 1024).
        diloco_every: H, DiLoCo's local steps between two all-reduces.
        allreduce: ``"ring"`` or ``"best"`` (``costs.allreduce_cost``).
    """

    shapes: tuple[tuple[int, ...], ...]
    compute_s: float
    rank: int = 4
    iterations: int = 2
    factor_bytes: int = 2
    second_moment_every: int = 64
    sign_chunk: int = 256
    sign_levels: int = 4
    tracker_hops: int | None = None
    diloco_every: int = 10
    allreduce: str = "best"

    @property
    def params(self) -> int:
        """P, the parameters."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def model_bytes(self) -> int:
        """M = 4 P, the fp32 model (or gradient)."""
        return 4 * self.params

    def hops(self, n: int) -> int:
        """k, the trackers' messages a step at n workers.

        Raises:
            RuntimeModelError: ``tracker_hops`` is set below 1.
        """
        if self.tracker_hops is None:
            return gossip.default_tracker_hops(n)
        if self.tracker_hops < 1:
            raise RuntimeModelError(f"tracker_hops must be >= 1 (or None: the library's), got {self.tracker_hops}")
        return self.tracker_hops

    def sign_bytes(self) -> int:
        """One trackers' message: the scaled-sign code of every tensor."""
        return sum(sign_message_bytes(math.prod(s), self.sign_chunk, self.sign_levels) for s in self.shapes)

    def powergossip_bytes(self, n: int) -> float:
        """PowerGossip's bytes per worker per step on the one-peer hypercube of n workers."""
        schedule = topologies.one_peer_hypercube(n)
        return topologies.bytes_per_step(
            schedule, self.shapes, "powergossip", rank=self.rank, bytes_per_element=self.factor_bytes,
            iterations=self.iterations,
        )  # fmt: skip


def _check(n: int, bandwidth_Bps: float, latency_s: float) -> None:
    if n < 2 or n & (n - 1):
        raise RuntimeModelError(f"n={n}: the cluster prediction uses the one-peer hypercube, n a power of two >= 2")
    if not bandwidth_Bps > 0 or latency_s < 0:
        raise RuntimeModelError(f"bandwidth must be > 0 and latency >= 0, got {bandwidth_Bps=}, {latency_s=}")


def allreduce_s(work: Workload, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """T_AR: one all-reduce of M over n workers.

    Args:
        work: the workload.
        n: workers.
        bandwidth_Bps: bytes/s per worker.
        latency_s: alpha.

    Returns:
        Seconds.
    """
    _check(n, bandwidth_Bps, latency_s)
    return allreduce_cost(work.model_bytes, n, latency_s, bandwidth_Bps, work.allreduce)


def ddp_step(work: Workload, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """DDP's seconds per step: C + max(0, T_AR - C / 3) (module docstring).

    Args:
        work: the workload.
        n: workers.
        bandwidth_Bps: bytes/s per worker.
        latency_s: alpha.

    Returns:
        Seconds.
    """
    t_ar = allreduce_s(work, n, bandwidth_Bps, latency_s)
    return allreduce_iteration(work.compute_s, t_ar, n).total_s


def default_step(work: Workload, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """The default pipeline's seconds per step, averaged over one period of K steps (module docstring).

    Args:
        work: the workload.
        n: workers.
        bandwidth_Bps: bytes/s per worker.
        latency_s: alpha.

    Returns:
        Seconds.

    Raises:
        RuntimeModelError: log2 n hops do not fit in K steps (the library refuses that configuration).
    """
    _check(n, bandwidth_Bps, latency_s)
    sample_hops = int(math.log2(n))
    if sample_hops > work.second_moment_every:
        raise RuntimeModelError(
            f"n={n}: {sample_hops} hops of the mean gradient do not fit in {work.second_moment_every}"
        )
    base = work.iterations * latency_s + work.powergossip_bytes(n) / bandwidth_Bps
    hop = work.model_bytes / bandwidth_Bps
    comm = [base + (hop if t < sample_hops else 0.0) for t in range(work.second_moment_every)]
    trackers = work.hops(n) * (latency_s + work.sign_bytes() / bandwidth_Bps)
    return gossip_iteration(work.compute_s, comm, 1, n, optimizer_s=trackers).total_s


def diloco_step(work: Workload, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """DiLoCo's seconds per step: C + T_AR / H (module docstring).

    Args:
        work: the workload.
        n: workers.
        bandwidth_Bps: bytes/s per worker.
        latency_s: alpha.

    Returns:
        Seconds.
    """
    return work.compute_s + allreduce_s(work, n, bandwidth_Bps, latency_s) / work.diloco_every


METHODS = {"ddp": ddp_step, "default": default_step, "diloco": diloco_step}


def time_ratio(step_s: float, ddp_step_s: float, steps_ratio: float) -> float:
    """Time to DDP's final loss over DDP's: rho t / t_DDP.

    Args:
        step_s: the method's seconds per step.
        ddp_step_s: DDP's.
        steps_ratio: rho, the method's steps to DDP's final loss over DDP's.

    Returns:
        The ratio.
    """
    if not steps_ratio > 0:
        raise RuntimeModelError(f"steps_ratio must be > 0, got {steps_ratio!r}")
    return steps_ratio * step_s / ddp_step_s


def table(
    work: Workload,
    workers: Sequence[int],
    rates: Sequence[str],
    latency_s: float,
    ratios: dict[str, Sequence[float]],
) -> list[dict]:
    """One row per (rate, n, method): seconds per step and time to DDP's loss over DDP's at each steps ratio.

    Args:
        work: the workload.
        workers: the n.
        rates: tc-style rates (``"100gbit"``).
        latency_s: alpha.
        ratios: per method (``"default"``, ``"diloco"``) the steps ratios to evaluate; DDP's is 1.

    Returns:
        The rows.
    """
    rows = []
    for rate in rates:
        bandwidth = parse_rate(rate, unit="byte/s")
        for n in workers:
            ddp = ddp_step(work, n, bandwidth, latency_s)
            for method, step in METHODS.items():
                seconds = step(work, n, bandwidth, latency_s)
                chosen = [1.0] if method == "ddp" else list(ratios.get(method, ()))
                rows.append({"rate": rate, "workers": n, "method": method, "ms_per_step": 1e3 * seconds,
                             "time_ratio": {r: time_ratio(seconds, ddp, r) for r in chosen}})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m experiments.runtime_model.cluster --help``).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rates", nargs="+", default=["100gbit", "10gbit"])
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--tokens-per-gpu", type=int, default=16 * 1024, help="tokens per worker per step")
    parser.add_argument("--tflops", type=float, default=100.0, help="sustained TFLOP/s per GPU (compute = 6 P T)")
    parser.add_argument("--default-ratios", type=float, nargs="+", default=[1.0, 1.2, 1.5])
    parser.add_argument("--diloco-ratios", type=float, nargs="+", default=[1.0, 1.2, 1.5])
    parser.add_argument("--diloco-every", type=int, default=10)
    parser.add_argument("--allreduce", choices=("best", "ring"), default="best")
    parser.add_argument(
        "--tracker-hops", type=int, default=None, help="the default's tracker messages a step (default: the library's)"
    )
    args = parser.parse_args(argv)
    shapes = tuple(gpt2_shapes(*GPT2_SMALL))
    params = sum(math.prod(s) for s in shapes)
    compute = 6 * params * args.tokens_per_gpu / (args.tflops * 1e12)
    work = Workload(
        shapes, compute, tracker_hops=args.tracker_hops, diloco_every=args.diloco_every, allreduce=args.allreduce
    )
    ratios = {"default": args.default_ratios, "diloco": args.diloco_ratios}
    rows = table(work, args.workers, args.rates, args.latency_us * 1e-6, ratios)
    factors = work.powergossip_bytes(args.workers[0]) / 1e6
    print(f"GPT-2 small, P = {params:,}; compute {1e3 * compute:.1f} ms a step (6 P x {args.tokens_per_gpu} tokens at "
          f"{args.tflops:g} TFLOP/s); alpha {args.latency_us:g} us; DiLoCo H = {args.diloco_every}; bytes a step "
          f"per worker: trackers {work.sign_bytes() / 1e6:.1f} MB a hop, PowerGossip {factors:.2f} MB (n = "
          f"{args.workers[0]}), model {work.model_bytes / 1e6:.0f} MB")  # fmt: skip
    print("| rate | n | method | ms / step | time to DDP's final loss ÷ DDP's, at steps ratio |")
    print("|---|---|---|---:|---|")
    for row in rows:
        cells = ", ".join(f"{ratio:g}×: {value:.2f}" for ratio, value in row["time_ratio"].items())
        method = row["method"] + (f" ({work.hops(row['workers'])} tracker hops)" if row["method"] == "default" else "")
        print(f"| {row['rate']} | {row['workers']} | {method} | {row['ms_per_step']:.1f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
