"""PowerGossip's own computation per step, as a share of forward + backward, before and after batching.

"Own computation" is everything PowerGossip does on one rank in a step except waiting for the network:
orthonormalising the factors, the products X q / X^T p, packing the message, the difference of the two ends'
products and the rank-r update X += alpha p q^T. It is measured on a :class:`LoopbackCommunicator`: rank 0 of a
world of 2 whose exchange completes at once, handing back half of what it sent as the peer's message (the same
shapes and realistic magnitudes, no network). The same process times forward + backward of the model on the
main job's batch, so the share is a ratio of two times measured side by side.

Two positions are timed each round. **In a step**, the one that counts: as in training, the variant's own AdamW
step over its parameters runs (untimed; ``--before none`` leaves it out, as this benchmark did before, so that the
previous variant's work precedes), then ``start`` (iteration 0 posted), then forward + backward, then ``finish``
(iteration 0 applied, the further iterations posted and applied); the own computation is start + finish, and the
share is its ratio to that round's forward + backward (median over rounds). After forward + backward the CPU's
caches hold the model's activations and other code, so each of PowerGossip's small operations costs more than back
to back. **Isolated**: one more step right after, warm, as earlier versions of this benchmark measured it (a
lower bound).

Old vs new in one run: ``--baseline REV`` loads ``gossip/algorithms/powergossip.py`` as it was at git revision
``REV`` (default: the last revision before matrices were batched) into a separate module, and the two
implementations run interleaved, round by round, on two copies of the same model. The ratio old / new is the
speed-up of the batched implementation. The last column counts the aten operations of one step (each a kernel
launch, or a view, on a GPU; their fixed cost, not the arithmetic, dominates there at these sizes).
``--bucket-bytes`` smaller than a layer spreads each group of layers over several buckets, as the default 25 MiB
buckets do with GPT-2 small's 28 MB blocks.

Usage::

    python benchmarks/powergossip_compute.py                       # the main job's GPT, CPU, ranks 1 and 4
    python benchmarks/powergossip_compute.py --layers 12 --embd 768 --block 1024 --batch 8 --device cuda
    python benchmarks/powergossip_compute.py --layers 12 --bucket-bytes 900000 --baseline 5689234  # 2 buckets a layer
    python benchmarks/powergossip_compute.py --kernels             # the kernels behind two design choices
    python benchmarks/powergossip_compute.py --profile --ranks 4   # where a step's own computation goes

``--kernels`` times, warm and back to back, the two choices the implementation rests on, for every group of the
model's matrices: orthonormalising its stacked factors by Gram-Schmidt's column loop against one batched
Householder QR, and computing the products as X q and X^T p (factors stored rows x r) against q^T X^T and p^T X
(factors stored transposed, as PowerGossip keeps them).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from baseline_revision import module_at_revision  # noqa: E402

import topologies  # noqa: E402
from gossip.algorithms.buckets import DEFAULT_BUCKET_BYTES, Bucket, bucket_parameters  # noqa: E402
from gossip.app.gpt import GPT, GPTConfig  # noqa: E402
from gossip.app.train import DEFAULTS  # noqa: E402
from gossip.backends.base import Communicator  # noqa: E402
from gossip.backends.comm_thread import Handle  # noqa: E402
from gossip.backends.wire import Transfer  # noqa: E402

BASELINE_REVISION = "40b881d"  # the last revision with the matrix-by-matrix PowerGossip


class _Done(Handle):
    wait_seconds = 0.0

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


class LoopbackCommunicator(Communicator):
    """Rank 0 of a world of ``size``: every exchange completes at once; each receive gets the matching send, halved
    except every ``AGREE_EVERY``-th element, which arrives as sent.

    For timing an algorithm's own computation without a network. The elements that arrive unchanged stand for a
    peer whose replica agrees with this one on some rows: in training, PowerGossip's R = a_hi - a_lo has zero
    elements at almost every iteration (on the main job 0.1-1.5 % of them, in every iteration but the first step's;
    measured with the simulator), and a peer that halves everything would spare the benchmark the code that such
    an R runs. No column of R is zero throughout (each has more than ``AGREE_EVERY`` elements), as in training
    after the first step. Integer messages (packed sign bits) arrive as sent. Collectives act on this rank alone.
    """

    backend = "loopback"
    AGREE_EVERY = 64

    def __init__(self, size: int = 2, device: torch.device | str = "cpu"):
        super().__init__()
        self.rank, self.size, self.local_rank, self.local_size = 0, size, 0, 1
        self.device, self.timeout = torch.device(device), 60.0
        self._scales: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def _scale(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.numel(), tensor.dtype)
        if key not in self._scales:
            scale = torch.full((tensor.numel(),), 0.5, dtype=tensor.dtype, device=tensor.device)
            scale[:: self.AGREE_EVERY] = 1.0
            self._scales[key] = scale
        return self._scales[key]

    def _start_exchange(self, sends: list[Transfer], recvs: list[Transfer], seq: int) -> Handle:
        for send, recv in zip(sends, recvs, strict=True):
            if send.tensor.is_floating_point():  # the scale is flat: match it by flattening both (contiguous) ends
                torch.mul(send.tensor.view(-1), self._scale(send.tensor), out=recv.tensor.view(-1))
            else:  # packed bits (scaled-sign messages) arrive as sent
                recv.tensor.copy_(send.tensor)
        return _Done()

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        return _Done()

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        return _Done()

    def barrier(self, timeout: float | None = None) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.size

    def close(self) -> None:
        return None


def as_template_hooks(source: str) -> str:
    """An algorithm module written before ``Algorithm`` ran ``start`` and ``finish`` itself (which refuses a
    subclass overriding them): its ``start``/``finish`` become the ``_start_step``/``_finish_step`` they call, and
    its call of the bookkeeping that ``start`` now does (``self._begin_step()``) goes."""
    source = re.sub(r"^(\s+)def start\(", r"\1def _start_step(", source, flags=re.MULTILINE)
    source = re.sub(r"^(\s+)def finish\(", r"\1def _finish_step(", source, flags=re.MULTILINE)
    return re.sub(r"^[ \t]+self\._begin_step\(\)\n", "", source, flags=re.MULTILINE)


def load_baseline(revision: str, path: str | None = None) -> type:
    """``PowerGossip`` as defined in ``gossip/algorithms/powergossip.py`` at git ``revision`` (or in file ``path``),
    adapted to the current ``Algorithm`` (:func:`as_template_hooks`)."""
    module = module_at_revision(
        "gossip/algorithms/powergossip.py", revision, "powergossip_baseline", path, adapt=as_template_hooks
    )
    return module.PowerGossip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(run: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def add_gpt2_small_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layers --embd --heads --block --vocab`` with GPT-2 small's sizes as defaults (the GPU benchmarks')."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The GPT of the size arguments ``add_gpt2_small_arguments`` (or this script's own) parsed."""
    return GPTConfig(
        block_size=args.block, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, n_embd=args.embd
    )


def model_buckets(
    config: GPTConfig, device: torch.device, seed: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[GPT, list[Bucket]]:
    torch.manual_seed(seed)
    model = GPT(config).to(device)
    return model, bucket_parameters(model, bucket_bytes)


def forward_backward(model: GPT, config: GPTConfig, batch: int, device: torch.device) -> Callable[[], None]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=generator).to(device)

    def run() -> None:
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()

    return run


def in_a_step(
    algorithm: Any, forward_backward: Callable[[], None], step: int, device: torch.device
) -> tuple[float, float]:
    """Seconds of ``algorithm``'s own computation in training position (start, forward + backward, finish) and of
    the forward + backward between."""
    synchronize(device)
    begin = time.perf_counter()
    pending = algorithm.start(step)
    synchronize(device)
    started = time.perf_counter()
    forward_backward()
    synchronize(device)
    computed = time.perf_counter()
    algorithm.finish(pending)
    synchronize(device)
    return (started - begin) + (time.perf_counter() - computed), computed - started


def optimizer_step(buckets: list[Bucket], seed: int = 0) -> Callable[[], None]:
    """An AdamW step (torch's, foreach) over the parameters in ``buckets`` with fixed random gradients and a
    negligible learning rate: what training runs right before PowerGossip's ``start``, reading and writing every
    parameter (the wrapper's parameters are views of the buckets)."""
    generator = torch.Generator().manual_seed(seed)
    parameters = [torch.nn.Parameter(bucket.buffer) for bucket in buckets]  # the same storage
    for parameter in parameters:
        parameter.grad = 1e-3 * torch.randn(parameter.shape, generator=generator).to(parameter)
    optimizer = torch.optim.AdamW(parameters, lr=1e-12, weight_decay=0.0)
    return optimizer.step


def bound_step(algorithm: Any, buckets: list[Bucket], device: torch.device) -> Callable[[], None]:
    """``algorithm`` set up on a loopback rank 0 of 2; the callable runs one step (start + finish)."""
    algorithm.setup(LoopbackCommunicator(2, device), topologies.one_peer_hypercube(2), buckets)
    step = iter(range(10**9))
    return lambda: algorithm.step(next(step))


class CountOps(TorchDispatchMode):
    """Counts the aten operations run on this thread: on a GPU each is a kernel launch (or a view), whose fixed
    cost dominates PowerGossip's step at these sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def operations(run: Callable[[], None], steps: int = 2) -> float:
    """Aten operations per call of ``run``, averaged over ``steps`` calls (a left and a right multiplication)."""
    with CountOps() as counter:
        for _ in range(steps):
            run()
    return counter.count / steps


def median_seconds(run: Callable[[], Any], device: torch.device, warmup: int = 10, rounds: int = 200) -> float:
    """The median of ``rounds`` timings of ``run`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    return statistics.median(seconds(run, device) for _ in range(rounds))


def kernels(config: GPTConfig, ranks: list[int], device: torch.device) -> None:
    """Print, per group of the model's matrices and rank: Gram-Schmidt vs QR on its factors, and the products
    with the factors stored rows x r vs transposed (microseconds, warm medians)."""
    from gossip.algorithms.powergossip import PowerGossip
    from gossip.algorithms.powergossip_factors import gram_schmidt, orthonormalize

    _, buckets = model_buckets(config, device, 0)
    print(
        f"{'group (count x m x k)':>24} {'r':>3} {'GS us':>8} {'QR us':>8} {'GS/QR':>6} "
        f"{'Xq us':>7} {'q^TX^T':>7} {'ratio':>6} {'X^Tp us':>8} {'p^TX':>7} {'ratio':>6}"
    )
    for rank in ranks:
        algorithm = PowerGossip(rank=rank)
        algorithm.setup(LoopbackCommunicator(2, device), topologies.one_peer_hypercube(2), buckets)
        for views in algorithm._views:
            x = views[0][1]  # the group's first run: (count, m, k)
            count, m, k = x.shape
            q, p = torch.randn(count, k, rank, device=device), torch.randn(count, m, rank, device=device)
            qt, pt = q.mT.contiguous(), p.mT.contiguous()
            factor = torch.randn(count, rank, m, device=device).mT  # p as PowerGossip stores it
            gs = median_seconds(lambda f=factor: gram_schmidt(f, dtype=f.dtype), device)
            qr = median_seconds(lambda f=factor: orthonormalize(f, dtype=f.dtype, method="qr"), device)
            xq = median_seconds(lambda x=x, q=q: torch.bmm(x, q), device)
            qtxt = median_seconds(lambda x=x, qt=qt: torch.bmm(qt, x.mT), device)
            xtp = median_seconds(lambda x=x, p=p: torch.bmm(x.mT, p), device)
            ptx = median_seconds(lambda x=x, pt=pt: torch.bmm(pt, x), device)
            print(
                f"{f'{count} x {m} x {k}':>24} {rank:>3} {gs * 1e6:8.1f} {qr * 1e6:8.1f} {gs / qr:6.2f} "
                f"{xq * 1e6:7.1f} {qtxt * 1e6:7.1f} {xq / qtxt:6.2f} {xtp * 1e6:8.1f} {ptx * 1e6:7.1f} {xtp / ptx:6.2f}"
            )


def profile_in_a_step(
    algorithm: Any,
    forward_backward: Callable[[], None],
    rounds: int,
    warmup: int,
    before: Callable[[], Any] | None = None,
) -> None:
    """Print where ``algorithm``'s own computation in a step goes: torch.profiler's self CPU time of each operation
    run inside ``start`` and ``finish`` (forward + backward between them, as in training), per step. The profiler
    adds its own cost to every operation, so the column sums to more than the unprofiled time; the shares tell
    what dominates."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def step(index: int) -> None:
        if before is not None:
            before()
        with record_function("powergossip"):
            pending = algorithm.start(index)
        forward_backward()
        with record_function("powergossip"):
            algorithm.finish(pending)

    for index in range(warmup):
        step(index)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for index in range(warmup, warmup + rounds):
            step(index)
    events = profiler.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == "powergossip"]
    totals: dict[str, list[float]] = {}
    for event in events:
        if event.name != "powergossip" and any(a <= event.time_range.start <= b for a, b in spans):
            entry = totals.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.self_cpu_time_total
    wall = sum(b - a for a, b in spans)
    print(f"profiled, per step: {wall / rounds:.0f} us inside start + finish (profiler included)")
    print(f"{'operation':>28} {'calls':>6} {'self us':>8}")
    for name, (calls, micros) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"{name:>28} {calls / rounds:6.1f} {micros / rounds:8.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4], help="PowerGossip ranks to measure")
    parser.add_argument(
        "--iterations",
        type=int,
        default=DEFAULTS.power_iterations,
        help=f"power iterations per step (default: the main job's, {DEFAULTS.power_iterations})",
    )
    parser.add_argument("--rounds", type=int, default=30, help="measured rounds (each: one step of everything)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--baseline", default=BASELINE_REVISION, help="git revision of the old implementation")
    parser.add_argument("--baseline-file", default=None, help="the old powergossip.py, where no git history is at hand")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=GPTConfig.n_layer)
    parser.add_argument("--embd", type=int, default=GPTConfig.n_embd)
    parser.add_argument("--heads", type=int, default=GPTConfig.n_head)
    parser.add_argument("--block", type=int, default=GPTConfig.block_size)
    parser.add_argument("--batch", type=int, default=16, help="per-worker batch (the main job's default: 16)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a main-job worker: cores // 4)")
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        default=DEFAULT_BUCKET_BYTES,
        help="bucket size (default 25 MiB); smaller than a layer spreads each group over several buckets, as "
        "GPT-2 small's 28 MB blocks are with the default",
    )
    parser.add_argument("--vocab", type=int, default=GPTConfig.vocab_size)
    parser.add_argument(
        "--kernels", action="store_true", help="time Gram-Schmidt vs QR and the product layouts per group, and stop"
    )
    parser.add_argument(
        "--ops-only", action="store_true", help="only count the operations per step (no timing; any model size)"
    )
    parser.add_argument(
        "--before",
        choices=["optimizer", "none"],
        default="optimizer",
        help="what runs (untimed) right before each variant's step in training position: its own AdamW step, as in "
        "training (default), or nothing (the previous variant's step; this benchmark's protocol before)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the defaults (float16 messages) in a training step: self CPU time per operation, and stop",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from gossip.algorithms.powergossip import PAD_RATIO, PowerGossip, PowerGossipTuning

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("powergossip_compute: skipped, no CUDA device here; leave out --device cuda to measure on the CPU")
        return
    config = GPTConfig(
        block_size=args.block, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, n_embd=args.embd
    )
    if args.kernels:
        print(f"model: GPT {args.layers} layers x {args.embd}; device {device}; {args.threads} thread(s); warm medians")
        kernels(config, args.ranks, device)
        return
    Old = load_baseline(args.baseline, args.baseline_file)
    if args.ops_only:
        _, buckets = model_buckets(config, device, 0, args.bucket_bytes)
        print(
            f"model: GPT {args.layers} layers x {args.embd}, vocab {args.vocab}, block {args.block}; {len(buckets)} "
            f"bucket(s) of at most {args.bucket_bytes} bytes; {args.iterations} power iteration(s) per step; "
            f"baseline revision {args.baseline}"
        )
        print(f"{'rank':>4} {'variant':>10} {'ops/step':>9}")
        for rank in args.ranks:
            # CUDA's defaults: Gram-Schmidt, and factors of similar rows share one call (pad_ratio)
            cuda_tuning = PowerGossipTuning(pad_ratio=PAD_RATIO, orthonormalization="gram-schmidt")
            as_on_cuda = partial(PowerGossip, tuning=cuda_tuning)
            for label, make in (("old", Old), ("new", PowerGossip), ("new CUDA", as_on_cuda)):
                step = bound_step(make(rank=rank, num_iterations=args.iterations), buckets, device)
                step(), step()  # the first steps create the edge's state
                print(f"{rank:>4} {label:>10} {operations(step):9.0f}")
        return
    model, _ = model_buckets(config, device, 0)
    fwd_bwd = forward_backward(model, config, args.batch, device)
    if args.profile:
        for rank in args.ranks:
            _, buckets = model_buckets(config, device, 0, args.bucket_bytes)
            algorithm = PowerGossip(rank=rank, num_iterations=args.iterations, message_dtype=torch.float16)
            algorithm.setup(LoopbackCommunicator(2, device), topologies.one_peer_hypercube(2), buckets)
            print(f"rank {rank}, {args.iterations} power iteration(s), float16 messages:")
            update = optimizer_step(buckets) if args.before == "optimizer" else None
            profile_in_a_step(algorithm, fwd_bwd, args.rounds, args.warmup, update)
        return
    variants: dict[str, Callable[[int], Any]] = {
        "old": lambda rank: Old(rank=rank, num_iterations=args.iterations),
        "new": lambda rank: PowerGossip(rank=rank, num_iterations=args.iterations),
        "new fp64": lambda rank: PowerGossip(
            rank=rank, num_iterations=args.iterations, tuning=PowerGossipTuning(orthonormalize_dtype=torch.float64)
        ),
        "new fp16 msg": lambda rank: PowerGossip(
            rank=rank, num_iterations=args.iterations, message_dtype=torch.float16
        ),
    }
    algorithms: dict[str, Any] = {}
    before: dict[str, Callable[[], Any]] = {}  # run untimed right before each variant's step in training position
    for rank in args.ranks:
        for label, make in variants.items():
            _, buckets = model_buckets(config, device, 0, args.bucket_bytes)
            name = f"{label} r={rank}"
            algorithm = algorithms[name] = make(rank)
            algorithm.setup(LoopbackCommunicator(2, device), topologies.one_peer_hypercube(2), buckets)
            before[name] = optimizer_step(buckets) if args.before == "optimizer" else lambda: None
    shares: dict[str, list[float]] = {name: [] for name in algorithms}
    in_step: dict[str, list[float]] = {name: [] for name in algorithms}
    isolated: dict[str, list[float]] = {name: [] for name in algorithms}
    compute: list[float] = []
    for round_ in range(args.warmup + args.rounds):
        order = list(algorithms.items())
        for name, algorithm in order if round_ % 2 == 0 else order[::-1]:  # alternating who goes first
            before[name]()
            own, base = in_a_step(algorithm, fwd_bwd, 2 * round_, device)
            alone = seconds(partial(algorithm.step, 2 * round_ + 1), device)
            if round_ >= args.warmup:
                shares[name].append(own / base)
                in_step[name].append(own)
                isolated[name].append(alone)
                compute.append(base)
    median = {name: statistics.median(values) for name, values in in_step.items()}
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"model: GPT {args.layers} layers x {args.embd}, {parameters / 1e6:.2f} M parameters; batch {args.batch} x "
        f"{args.block} tokens; device {device}; {args.threads} thread(s); {len(buckets)} bucket(s) of at most "
        f"{args.bucket_bytes} bytes; {args.iterations} power iteration(s) per step; baseline revision {args.baseline}; "
        f"{args.rounds} rounds, medians"
    )
    print(f"forward+backward: {statistics.median(compute) * 1e3:.2f} ms")
    print(
        "PowerGossip's own computation per step (orthonormalisation in float32, the default, unless marked fp64; "
        "fp16 msg: products sent in float16):"
    )
    print(
        f"{'rank':>4} {'variant':>12} {'in a step ms':>13} {'% fwd+bwd':>10} {'old / this':>11} {'isolated ms':>12} "
        f"{'ops/step':>9}"
    )
    for rank in args.ranks:
        for label in variants:
            name = f"{label} r={rank}"
            this, old = median[name], median[f"old r={rank}"]
            share = 100 * statistics.median(shares[name])
            alone = statistics.median(isolated[name]) * 1e3
            later = iter(range(2 * (args.warmup + args.rounds), 10**9))  # steps after the timed ones
            ops = operations(lambda algorithm=algorithms[name], later=later: algorithm.step(next(later)))
            print(f"{rank:>4} {label:>12} {this * 1e3:13.3f} {share:9.2f}% {old / this:11.2f} {alone:12.3f} {ops:9.0f}")


if __name__ == "__main__":
    main()
