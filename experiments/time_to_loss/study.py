r"""Time-to-loss benchmark: All-Reduce (torch DDP) vs gossip vs decent-dp on an emulated network, side by side.

DiLoCo (``gossip-train --algorithm diloco``: H local AdamW steps, then an all-reduce of the pseudo-gradient and an
outer Nesterov SGD step) is the second baseline: methods ``diloco-h<H>-adamw``, compared with DDP like every other
method (the ratio to DDP's time; with ``--gossip-steps`` DiLoCo gets the gossip methods' budget).

Every method trains the same task (``gossip-train``'s GPT, corpus, batches, seed, lr schedule, steps) as one Gloo
process per emulated host (``experiments.netem``), one method after the other inside ONE network, so they share the
machine's conditions. From each run's ``metrics.csv``:

* target :math:`L^*` = DDP's final training loss: the mean over ranks of the loss, averaged over the last 10 steps
  (``gossip.app.run_dir.FINAL_WINDOW``) -- the training loss, not the validation loss;
* smoothed loss :math:`\bar L_t = \frac{1}{w} \sum_{s=t-w+1}^{t} L_s` (trailing moving average, w = 10, fewer at the
  start), :math:`L_s` the mean over ranks at step s;
* time to target = wall clock at the first step with :math:`\bar L_t \le L^*`, the clock starting at the end of
  step ``CLOCK_START_STEP`` (= 1) for every method, so one-off set-up in the first two steps (Gloo connections,
  decent-dp's lazy initialisation, DDP's bucket rebuild) is not counted; ``nan`` if never reached;
* ratio = time to target / DDP's time to target (< 1: faster than All-Reduce to DDP's own final loss);
* final-loss gap at equal steps = final training loss - DDP's final training loss (> 0: worse);
* common loss = the largest final training loss among the methods compared (every method reaches it), the time to
  it and its ratio to DDP's: the comparison that still exists when a method never reaches DDP's final loss;
* best gossip loss = the smallest final training loss among the non-DDP methods; time to it and ratio to DDP's.

``--gossip-steps N`` gives every method but DDP a budget of N steps (each with its own lr schedule over its N
steps), so a method slower per step than DDP in loss can still reach DDP's final loss and the ratio is defined; the
final-loss gap is then at unequal steps (column ``steps``).

``--seeds S ...`` trains every method once per seed (model initialisation and batches; ``--seed`` of the main
job), so a ratio comes with its spread over seeds; ``--repeats`` repeats the passes with the same seeds (timing
noise only).

``--from-runs DIR`` re-analyses finished run directories (named ``<stamp>-<rate>-r<repeat>-s<seed>-<method>``;
without ``-s<seed>``: seed 0) without training.

    python -m experiments.time_to_loss --hosts 8 --rates 100mbit 1gbit --steps 300 --batch-size 8 --seeds 0 1 2

Writes ``<results>/time_to_loss.csv`` (one row per rate, repeat, seed and method; ``--csv`` renames it),
``<csv stem>_summary.csv`` (per rate and method: mean and standard deviation over the runs of the ratio to DDP's time
and of the final-loss gap) and, per run, ``<csv stem>_<rate>_s<seed>[_r<repeat>].png`` (smoothed loss against
wall clock): files named by configuration and seed, so a rerun of a configuration replaces its results. Needs
root (netem) and, for ``decentdp``, decent-dp 0.2.3 (see ``experiments.time_to_loss.decentdp_runner``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import re
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from gossip.app.run_dir import FINAL_WINDOW

CLOCK_START_STEP = 1
RESULTS = Path(__file__).resolve().parent / "results"


class BenchmarkError(ValueError):
    """Bad benchmark input (unknown method, missing baseline, unreadable run); the message names it."""


@dataclasses.dataclass(frozen=True)
class Method:
    """A way to train the task: ``argv(steps, batch_size, out, seed)`` is one worker's command line."""

    name: str
    label: str
    argv: Callable[[int, int, str, int], list[str]]


def _common(steps: int, batch_size: int, seed: int) -> list[str]:
    return ["--steps", str(steps), "--batch-size", str(batch_size), "--eval-every", str(steps), "--seed", str(seed)]


def _gossip_train(*options: str) -> Callable[[int, int, str, int], list[str]]:
    def argv(steps: int, batch_size: int, out: str, seed: int = 0) -> list[str]:
        common = _common(steps, batch_size, seed)
        return [sys.executable, "-m", "gossip", *options, *common, "--log-every", str(steps), "--out", out]

    return argv


def _decent_dp(topology: str) -> Callable[[int, int, str, int], list[str]]:
    def argv(steps: int, batch_size: int, out: str, seed: int = 0) -> list[str]:
        common = _common(steps, batch_size, seed)
        runner = "experiments.time_to_loss.decentdp_runner"
        return [sys.executable, "-m", runner, "--topology", topology, *common, "--out", out]

    return argv


# Every method names its algorithm, optimizer and outer step (0: none, gossip alone), so that a change of
# gossip-train's defaults leaves it as labelled.
EXACT = ("--algorithm", "exact", "--schedule", "one_peer_hypercube", "--outer-every", "0")


def powergossip(
    rank: int, iterations: int = 1, message_dtype: str = "float32", outer_every: int = 0
) -> tuple[str, ...]:
    """PowerGossip at ``rank``, ``iterations`` power iterations per step, products sent in ``message_dtype``, on the
    one-peer hypercube; with an outer step every ``outer_every`` steps (0: none)."""
    return ("--algorithm", "powergossip", "--rank", str(rank), "--power-iterations", str(iterations),
            "--message-dtype", message_dtype, "--schedule", "one_peer_hypercube",
            "--outer-every", str(outer_every))  # fmt: skip


def diloco(local_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9) -> tuple[str, ...]:
    """DiLoCo with ``local_steps`` local steps between synchronisations and its outer Nesterov SGD's settings."""
    return ("--algorithm", "diloco", "--local-steps", str(local_steps), "--outer-lr", str(outer_lr),
            "--outer-momentum", str(outer_momentum))  # fmt: skip


def _diloco(local_steps: int) -> Method:
    """DiLoCo with AdamW as the inner optimizer, as in the paper, and the paper's outer lr 0.7, momentum 0.9."""
    label = f"DiLoCo H={local_steps}, outer Nesterov SGD lr 0.7 momentum 0.9, AdamW"
    return Method(f"diloco-h{local_steps}-adamw", label, _gossip_train(*diloco(local_steps), "--optimizer", "adamw"))


def _periodic_average(local_steps: int) -> Method:
    """DiLoCo's outer step at lr 1 without momentum: a plain average of the replicas every ``local_steps`` steps
    (AdamW inside), the best of the learning-per-step study's outer-step grid."""
    label = f"DiLoCo H={local_steps}, outer lr 1 without momentum (a plain average), AdamW"
    options = diloco(local_steps, outer_lr=1.0, outer_momentum=0.0)
    return Method(f"diloco-h{local_steps}-avg-adamw", label, _gossip_train(*options, "--optimizer", "adamw"))


def _hybrid_average(local_steps: int, delay: int = 0) -> Method:
    """The main job's PowerGossip every step and a plain average of the replicas every ``local_steps`` steps
    (``--outer-every``, outer lr 1 without momentum): the hybrid of the learning-per-step study. With ``delay``
    the average lands ``delay`` steps after it was posted, its all-reduce overlapping their compute, and each
    replica moves halfway to it (``--outer-delay``, ``--outer-merge 0.5``: Streaming DiLoCo's merge)."""
    label = f"PowerGossip r=4, 2 iterations, float16 messages, a plain average every {local_steps} steps, AdamW"
    options = [*powergossip(4, 2, "float16", outer_every=local_steps), "--outer-lr", "1.0"]
    options += ["--outer-momentum", "0.0", "--optimizer", "adamw"]
    if not delay:
        return Method(f"pg4-it2-fp16-h{local_steps}-avg-adamw", label, _gossip_train(*options))
    label += f", landing {delay} step(s) late and merged halfway"
    options += ["--outer-delay", str(delay), "--outer-merge", "0.5"]
    return Method(f"pg4-it2-fp16-h{local_steps}-d{delay}-avg-adamw", label, _gossip_train(*options))


def _momentum_tracking(
    name: str,
    label: str,
    *algorithm: str,
    trackers: str = "exact",
    every: int = 32,
    mean_gradient: str = "allreduce",
    sample_dtype: str = "",
    hops: int = 1,
) -> Method:
    """``algorithm`` for the parameters, gradient trackers carrying the optimizer's first moment, mixed exactly or
    by ``trackers`` (``--gradient-tracking``: ``sign`` for ``gossip.ChocoSign``'s scaled signs), and the mean
    gradient's second moment (``optim.MomentumTrackingAdamW``) sampled every ``every`` steps (the learning-per-step
    study's ``*-mt-sharedv32`` and ``*-mtsign4-c256-sharedv64``), averaged as ``mean_gradient`` says, a gossiped
    sample's hops in ``sample_dtype`` (``""``: the main job's default), or with ``every = 0`` read off the trackers
    (``--second-moment tracker``); the trackers mixed ``hops`` times a step (``--tracker-hops``)."""
    options = [*algorithm, "--gradient-tracking", trackers, "--optimizer", "momentum-tracking-adamw"]
    options += ["--tracker-hops", str(hops)]
    label += f", {'exact' if trackers == 'exact' else trackers + '-compressed'} momentum trackers"
    label += f" ({hops} hops a step)" if hops > 1 else ""
    if not every:
        label += ", the mean gradient's second moment from the trackers"
        return Method(name, label, _gossip_train(*options, "--second-moment", "tracker"))
    label += ", the mean"
    label += f" gradient's second moment every {every} steps by {mean_gradient}"
    options += ["--second-moment-every", str(every), "--mean-gradient", mean_gradient]
    if sample_dtype:
        label += f" in {sample_dtype}"
        options += ["--mean-gradient-dtype", sample_dtype]
    return Method(name, label, _gossip_train(*options))


def _pga(name: str, *, rank: int, iterations: int, every: int, adamw: bool) -> Method:
    """PowerGossip (``rank``, ``iterations`` per step) with an exact global average every ``every`` steps."""
    label = f"PowerGossip r={rank}, {iterations} iteration(s), one-peer hypercube, exact average every {every} steps"
    options = [*powergossip(rank, iterations), "--average-every", str(every)]
    if adamw:
        label = f"{label}, AdamW"
    return Method(name, label, _gossip_train(*options, "--optimizer", "adamw" if adamw else "accum-adamw"))


METHODS = {
    m.name: m
    for m in (
        Method("ddp", "DDP all-reduce (AdamW)", _gossip_train("--algorithm", "ddp", "--optimizer", "adamw")),
        Method(
            "ddp-accum",
            "DDP all-reduce (AccumAdamW)",
            _gossip_train("--algorithm", "ddp", "--optimizer", "accum-adamw"),
        ),
        Method("exact", "exact gossip, one-peer hypercube", _gossip_train(*EXACT, "--optimizer", "accum-adamw")),
        Method(
            "exact-adamw",
            "exact gossip, one-peer hypercube, AdamW",
            _gossip_train(*EXACT, "--optimizer", "adamw"),
        ),
        Method(
            "exact-accum4",
            "exact gossip, one-peer hypercube, accum_iter 4",
            _gossip_train(*EXACT, "--optimizer", "accum-adamw", "--accum-iter", "4"),
        ),
        Method(
            "exact-lr1e-3",
            "exact gossip, one-peer hypercube, lr 1e-3",
            _gossip_train(*EXACT, "--optimizer", "accum-adamw", "--lr", "1e-3"),
        ),
        Method(
            "exact-ring",
            "exact gossip, ring",
            _gossip_train(
                "--algorithm", "exact", "--schedule", "ring", "--outer-every", "0", "--optimizer", "accum-adamw"
            ),
        ),
        *(
            Method(
                f"pg{r}",
                f"PowerGossip r={r}, one-peer hypercube",
                _gossip_train(*powergossip(r), "--optimizer", "accum-adamw"),
            )
            for r in (1, 2, 4)
        ),
        Method(
            "pg4-adamw",
            "PowerGossip r=4, one-peer hypercube, AdamW",
            _gossip_train(*powergossip(4), "--optimizer", "adamw"),
        ),
        Method(
            "pg1-it4-adamw",
            "PowerGossip r=1, 4 iterations, one-peer hypercube, AdamW",
            _gossip_train(*powergossip(1, 4), "--optimizer", "adamw"),
        ),
        Method(
            "pg4-it2-adamw",
            "PowerGossip r=4, 2 iterations, one-peer hypercube, AdamW",
            _gossip_train(*powergossip(4, 2), "--optimizer", "adamw"),
        ),
        Method(
            "pg4-it2-fp16-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages, one-peer hypercube, AdamW (the main job's PowerGossip)",
            _gossip_train(*powergossip(4, 2, "float16"), "--optimizer", "adamw"),
        ),
        Method(
            "pg4-it7-fp16-adamw",
            "PowerGossip r=4, 7 iterations, float16 messages, one-peer hypercube, AdamW",
            _gossip_train(*powergossip(4, 7, "float16"), "--optimizer", "adamw"),
        ),
        _pga("pg4-pga16-adamw", rank=4, iterations=1, every=16, adamw=True),
        _pga("pg4-pga16", rank=4, iterations=1, every=16, adamw=False),
        _pga("pg4-pga8-adamw", rank=4, iterations=1, every=8, adamw=True),
        _pga("pg1-pga16-adamw", rank=1, iterations=1, every=16, adamw=True),
        _pga("pg4-it4-pga16-adamw", rank=4, iterations=4, every=16, adamw=True),
        Method(
            "exact-pga16-adamw",
            "exact gossip, one-peer hypercube, exact average every 16 steps, AdamW",
            _gossip_train(*EXACT, "--average-every", "16", "--optimizer", "adamw"),
        ),
        # the low-communication baseline: 1/20 of DDP's bytes (the byte budget) and 1/50
        _diloco(20),
        _diloco(50),
        _periodic_average(10),
        _hybrid_average(10),
        _hybrid_average(10, delay=1),  # the defaults' average overlapped with the next step (issue 27)
        # the configurations that reach DDP's loss per step (issue 27's momentum tracking)
        _momentum_tracking("exact-mt-adamw", "exact gossip, one-peer hypercube", *EXACT),
        _momentum_tracking(
            "pg4-it2-fp16-mt-adamw", "PowerGossip r=4, 2 iterations, float16 messages", *powergossip(4, 2, "float16")
        ),
        _momentum_tracking(
            "pg4-it2-fp16-mtsign-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages",
            *powergossip(4, 2, "float16"),
            trackers="sign",
            every=64,
        ),
        # the default pipeline with the second moment read off the trackers (--second-moment tracker), one hop
        _momentum_tracking(
            "pg4-it2-fp16-mtsign-trackv-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages",
            *powergossip(4, 2, "float16"),
            trackers="sign",
            every=0,
        ),
        # the same with three tracker hops
        _momentum_tracking(
            "pg4-it2-fp16-mtsign3-trackv-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages",
            *powergossip(4, 2, "float16"),
            trackers="sign",
            every=0,
            hops=3,
        ),
        # the default pipeline from 9 to 16 workers (gossip.Pipeline): the mean gradient by gossip, three tracker hops
        _momentum_tracking(
            "pg4-it2-fp16-mtsign3-gossipv-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages",
            *powergossip(4, 2, "float16"),
            trackers="sign",
            every=64,
            mean_gradient="gossip",
            hops=3,
        ),
        # the same with two tracker hops (--tracker-hops 2)
        _momentum_tracking(
            "pg4-it2-fp16-mtsign2-gossipv-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages",
            *powergossip(4, 2, "float16"),
            trackers="sign",
            every=64,
            mean_gradient="gossip",
            hops=2,
        ),
        # the main job's defaults since issue 59 at up to 8 workers: the same with one tracker hop a step
        _momentum_tracking(
            "pg4-it2-fp16-mtsign-gossipv-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages",
            *powergossip(4, 2, "float16"),
            trackers="sign",
            every=64,
            mean_gradient="gossip",
        ),
        # the same with the sample's hops in float32, the default before the hops travelled in bfloat16
        _momentum_tracking(
            "pg4-it2-fp16-mtsign-gossipv32-adamw",
            "PowerGossip r=4, 2 iterations, float16 messages",
            *powergossip(4, 2, "float16"),
            trackers="sign",
            every=64,
            mean_gradient="gossip",
            sample_dtype="float32",
        ),
        Method("decentdp", "decent-dp 0.2.3, one-peer-exp", _decent_dp("one-peer-exp")),
        Method("decentdp-aer", "decent-dp 0.2.3, alternating-exp-ring", _decent_dp("alternating-exp-ring")),
    )
}
BASELINE = "ddp"
RUN_NAME = re.compile(
    r"(?P<stamp>\d{8}-\d{6})-(?P<rate>[0-9.]+[a-z]+)-r(?P<repeat>\d+)(?:-s(?P<seed>\d+))?-(?P<method>[a-z0-9-]+)"
)  # runs without "-s<seed>" predate --seeds and used the main job's default seed, 0


def smoothed(losses: Sequence[float], window: int = FINAL_WINDOW) -> np.ndarray:
    """Trailing moving average: entry t is the mean of losses[max(0, t - window + 1) : t + 1]."""
    values = np.asarray(losses, dtype=float)
    if window < 1:
        raise BenchmarkError(f"smoothing window must be >= 1, got {window}")
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def final_loss(losses: Sequence[float], window: int = FINAL_WINDOW) -> float:
    """Mean of the last ``window`` losses (gossip.app.run_dir's final training loss).

    Computed as the last entry of :func:`smoothed`, bit for bit, so a curve always reaches its own final loss.
    """
    if len(losses) == 0:
        raise BenchmarkError("final_loss of an empty loss curve")
    return float(smoothed(losses, window)[-1])


def time_to_target(losses: Sequence[float], seconds: Sequence[float], target: float, window: int = FINAL_WINDOW):
    """(step, seconds) of the first step whose smoothed loss is <= ``target``; (None, nan) if none is."""
    if len(losses) != len(seconds):
        raise BenchmarkError(f"{len(losses)} losses but {len(seconds)} times")
    reached = np.flatnonzero(smoothed(losses, window) <= target)
    if reached.size == 0:
        return None, math.nan
    return int(reached[0]), float(seconds[reached[0]])


@dataclasses.dataclass
class Curve:
    """One run's loss curve: mean-over-ranks loss and wall clock (from CLOCK_START_STEP) per step."""

    method: str
    losses: np.ndarray
    seconds: np.ndarray
    mean_step_seconds: float
    final_val_loss: float
    bytes_per_step: float


def read_curve(method: str, run_dir: Path) -> Curve:
    """The Curve of a finished run (its ``metrics.csv``, as written by gossip-train and decentdp_runner)."""
    path = Path(run_dir) / "metrics.csv"
    if not path.exists():
        raise BenchmarkError(f"{method}: no metrics.csv in {run_dir} (did the run fail? see its log)")
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    if len(rows) <= CLOCK_START_STEP + 1:
        raise BenchmarkError(f"{method}: {path} has {len(rows)} steps, need > {CLOCK_START_STEP + 1}")
    elapsed = np.array([float(r["elapsed_seconds"]) for r in rows])
    values = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    return Curve(
        method=method,
        losses=np.array([float(r["mean_loss"]) for r in rows]),
        seconds=elapsed - elapsed[CLOCK_START_STEP],
        mean_step_seconds=float(np.mean([float(r["step_seconds"]) for r in rows[CLOCK_START_STEP + 1 :]])),
        final_val_loss=values[-1] if values else math.nan,
        bytes_per_step=float(np.mean([float(r["bytes_sent"] or 0) for r in rows])),
    )


def compare(curves: Sequence[Curve], baseline: str = BASELINE) -> list[dict]:
    """One row per curve: final losses, time to the baseline's final loss, ratio and loss gap to the baseline."""
    base = next((c for c in curves if c.method == baseline), None)
    if base is None:
        raise BenchmarkError(f"no {baseline!r} run among {[c.method for c in curves]}; it sets the target loss")
    target = final_loss(base.losses)
    common = max(final_loss(c.losses) for c in curves)  # the loss every method reaches
    _, base_time = time_to_target(base.losses, base.seconds, target)
    _, base_common = time_to_target(base.losses, base.seconds, common)
    best = min(final_loss(c.losses) for c in curves if c.method != baseline)  # best decentralized final loss
    _, base_best = time_to_target(base.losses, base.seconds, best)
    rows = []
    for curve in curves:
        step, seconds = time_to_target(curve.losses, curve.seconds, target)
        common_step, common_seconds = time_to_target(curve.losses, curve.seconds, common)
        _, best_seconds = time_to_target(curve.losses, curve.seconds, best)
        final = final_loss(curve.losses)
        rows.append(
            {
                "method": curve.method,
                "steps": len(curve.losses),
                "target_loss": target,
                "final_train_loss": final,
                "final_val_loss": curve.final_val_loss,
                "loss_gap": final - target,
                "step_to_target": step,
                "seconds_to_target": seconds,
                "ratio_to_ddp": seconds / base_time,
                "common_loss": common,
                "step_to_common": common_step,
                "seconds_to_common": common_seconds,
                "common_ratio_to_ddp": common_seconds / base_common,
                "best_gossip_loss": best,
                "seconds_to_best_gossip": best_seconds,
                "best_gossip_ratio_to_ddp": best_seconds / base_best,
                "mean_step_ms": 1e3 * curve.mean_step_seconds,
                "total_seconds": float(curve.seconds[-1]),
                "bytes_per_step": curve.bytes_per_step,
            }
        )
    return rows


def step_budget(method: str, steps: int, gossip_steps: int | None) -> int:
    """Steps ``method`` trains for: ``steps`` for the baseline, ``gossip_steps`` (if given) for the others."""
    return steps if method == BASELINE or gossip_steps is None else gossip_steps


def run_method(
    net, method: Method, steps: int, batch_size: int, out: Path, port: int, log: Path, seed: int = 0
) -> float:
    """Run ``method`` on every host of ``net`` (Gloo, OMP_NUM_THREADS=1); output to ``log``; wall seconds."""
    from experiments.netem.launch import run_gloo

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    with open(log, "w") as sink:
        code = run_gloo(net, method.argv(steps, batch_size, str(out), seed), port, 3600, env, sink.write)
    if code != 0:
        raise RuntimeError(f"{method.name}: exit code {code}; see {log}")
    return time.perf_counter() - started


def plot(curves: Sequence[Curve], title: str, path: Path) -> None:
    """Smoothed training loss (mean over ranks) against wall clock, one line per method; target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gossip.app.run_dir import fit_titles

    figure, axis = plt.subplots(figsize=(8, 4.5 + 0.3 * len(curves)))
    for curve in curves:  # the labels are long: wrapped, in a legend below the axes
        axis.plot(curve.seconds, smoothed(curve.losses), label=textwrap.fill(METHODS[curve.method].label, 100))
    base = next(c for c in curves if c.method == BASELINE)
    axis.axhline(final_loss(base.losses), color="k", ls="--", lw=0.8, label="DDP final loss (target)")
    axis.set(xlabel="wall clock (s, from the end of step 1)", ylabel="train loss (mean over ranks, 10-step avg)")
    axis.set_ylim(top=min(4.0, axis.get_ylim()[1]))
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fit_titles(figure)
    figure.savefig(path, dpi=100)
    plt.close(figure)


FIELDS = ("rate", "delay_ms", "hosts", "repeat", "seed", "method", "steps", "target_loss", "final_train_loss",
          "final_val_loss", "loss_gap", "step_to_target", "seconds_to_target", "ratio_to_ddp", "common_loss",
          "step_to_common", "seconds_to_common", "common_ratio_to_ddp", "best_gossip_loss",
          "seconds_to_best_gossip", "best_gossip_ratio_to_ddp", "mean_step_ms", "total_seconds",
          "bytes_per_step")  # fmt: skip


def analyze(curves: Sequence[Curve], setting: dict, title: str, plot_path: Path) -> list[dict]:
    """compare() rows with the run's setting prepended, printed; the plot written to ``plot_path``."""
    rows = [{**setting, **row} for row in compare(curves)]
    for row in rows:
        print(_format(row), flush=True)
    plot(curves, title, plot_path)
    return rows


def plot_name(csv_name: str, rate: str, seed: int = 0, repeat: int = 0) -> str:
    """``<csv stem>_<rate>_s<seed>[_r<repeat>].png``: one file per configuration (the CSV's name, the rate), seed and
    repeat (``_r<repeat>`` only for repeats after the first)."""
    return f"{Path(csv_name).stem}_{rate}_s{seed}" + (f"_r{repeat}" if repeat else "") + ".png"


def finished_runs(root: Path) -> dict[tuple[str, str, int, int], list[tuple[str, Path]]]:
    """Run directories under ``root`` grouped by (stamp, rate, repeat, seed): [(method, path), ...] in name order."""
    groups: dict[tuple[str, str, int, int], list[tuple[str, Path]]] = {}
    for path in sorted(p for p in Path(root).iterdir() if (p / "metrics.csv").exists()):
        match = RUN_NAME.fullmatch(path.name)
        if match and match["method"] in METHODS:
            key = (match["stamp"], match["rate"], int(match["repeat"]), int(match["seed"] or 0))
            groups.setdefault(key, []).append((match["method"], path))
    return groups


SUMMARY_FIELDS = ("rate", "method", "runs", "seeds", "ratio_to_ddp_mean", "ratio_to_ddp_std", "runs_reaching_target",
                  "loss_gap_mean", "loss_gap_std", "final_train_loss_mean", "mean_step_ms", "bytes_per_step",
                  "bytes_vs_ddp")  # fmt: skip


def across_seeds(table: Sequence[dict]) -> list[dict]:
    """Per (rate, method): mean and sample standard deviation over the runs (seeds, repeats) of the ratio to DDP's
    time and of the final-loss gap; ``runs_reaching_target`` counts the runs with a ratio (the mean is over those)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in table:
        groups.setdefault((row["rate"], row["method"]), []).append(row)
    summary = []
    for (rate, method), rows in groups.items():
        ratios = [r["ratio_to_ddp"] for r in rows if math.isfinite(r["ratio_to_ddp"])]
        gaps = [r["loss_gap"] for r in rows]
        ddp_bytes = [r["bytes_per_step"] for r in table if r["rate"] == rate and r["method"] == BASELINE]
        bytes_per_step = float(np.mean([r["bytes_per_step"] for r in rows]))
        summary.append(
            {
                "rate": rate,
                "method": method,
                "runs": len(rows),
                "seeds": " ".join(str(s) for s in sorted({r["seed"] for r in rows})),
                "ratio_to_ddp_mean": float(np.mean(ratios)) if ratios else math.nan,
                "ratio_to_ddp_std": float(np.std(ratios, ddof=1)) if len(ratios) > 1 else math.nan,
                "runs_reaching_target": len(ratios),
                "loss_gap_mean": float(np.mean(gaps)),
                "loss_gap_std": float(np.std(gaps, ddof=1)) if len(gaps) > 1 else math.nan,
                "final_train_loss_mean": float(np.mean([r["final_train_loss"] for r in rows])),
                "mean_step_ms": float(np.mean([r["mean_step_ms"] for r in rows])),
                "bytes_per_step": bytes_per_step,
                "bytes_vs_ddp": bytes_per_step / float(np.mean(ddp_bytes)) if ddp_bytes else math.nan,
            }
        )
    return summary


def train_all(args: argparse.Namespace, results: Path) -> list[dict]:
    from experiments.netem import EmulatedNetwork

    stamp, table, port = time.strftime("%Y%m%d-%H%M%S"), [], 29600
    for rate in args.rates:
        with EmulatedNetwork(hosts=args.hosts, rate=rate, delay_ms=args.delay_ms) as net:
            for repeat, seed in ((r, s) for r in range(args.repeats) for s in args.seeds):
                curves = []
                for name in args.methods:
                    out = Path(args.runs) / f"{stamp}-{rate}-r{repeat}-s{seed}-{name}"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    port += 1
                    steps = step_budget(name, args.steps, args.gossip_steps)
                    log = Path(f"{out}.log")
                    wall = run_method(net, METHODS[name], steps, args.batch_size, out, port, log, seed)
                    curves.append(read_curve(name, out))
                    print(f"{rate} repeat {repeat} seed {seed} {name}: {wall:.0f} s wall, run dir {out}", flush=True)
                setting = {"rate": rate, "delay_ms": args.delay_ms, "hosts": args.hosts, "repeat": repeat, "seed": seed}
                budget = f"{args.steps} steps" + (f" ({args.gossip_steps} for gossip)" if args.gossip_steps else "")
                title = (
                    f"{args.hosts} hosts, {rate}, delay {args.delay_ms:g} ms, {budget}, seed {seed}, repeat {repeat}"
                )
                table += analyze(curves, setting, title, results / plot_name(args.csv, rate, seed, repeat))
    return table


def reanalyze(args: argparse.Namespace, results: Path) -> list[dict]:
    table = []
    for (stamp, rate, repeat, seed), members in finished_runs(Path(args.from_runs)).items():
        chosen = sorted((m, path) for m, path in members if m in args.methods)
        curves = [read_curve(m, path) for m, path in sorted(chosen, key=lambda item: list(METHODS).index(item[0]))]
        setting = {"rate": rate, "delay_ms": args.delay_ms, "hosts": args.hosts, "repeat": repeat, "seed": seed}
        budgets = "/".join(str(steps) for steps in sorted({len(curve.losses) for curve in curves}))
        title = f"{args.hosts} hosts, {rate}, {budgets} steps, run {stamp} r{repeat} seed {seed}"
        table += analyze(curves, setting, title, results / plot_name(args.csv, rate, seed, repeat))
    return table


def write_table(path: Path, fields: Sequence[str], rows: Sequence[dict]) -> None:
    """Write ``rows`` to the CSV at ``path``, columns ``fields`` in that order, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.time_to_loss", description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--rates", nargs="+", default=["100mbit"], help="per-host rate(s), tc units")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (> 0 uses the TUN forwarder)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--gossip-steps", type=int, default=None, help="step budget of every method but DDP (default: --steps)"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["ddp", "diloco-h20-adamw", "exact", "pg1", "pg4", "decentdp"])
    parser.add_argument("--repeats", type=int, default=1, help="passes over all methods, interleaved")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="seeds (model init, batches); each is a pass over all methods"
    )
    parser.add_argument("--runs", default="runs/time_to_loss", help="where the run directories go")
    parser.add_argument("--from-runs", default=None, help="re-analyse the finished runs in this directory")
    parser.add_argument("--results", default=str(RESULTS), help="where the CSV and plots go")
    parser.add_argument("--csv", default="time_to_loss.csv", help="CSV file name inside --results")
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or BASELINE not in args.methods:
        parser.error(f"--methods: unknown {unknown} (choose from {list(METHODS)}); {BASELINE!r} is required")
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    table = reanalyze(args, results) if args.from_runs else train_all(args, results)
    write_table(results / args.csv, FIELDS, table)
    summary = across_seeds(table)
    summary_path = results / f"{Path(args.csv).stem}_summary.csv"
    write_table(summary_path, SUMMARY_FIELDS, summary)
    for row in summary:
        print(
            f"  {row['rate']:>8} {row['method']:<13} over {row['runs']} run(s) (seeds {row['seeds']}): "
            f"x{row['ratio_to_ddp_mean']:.2f} ± {row['ratio_to_ddp_std']:.2f} of DDP's time "
            f"({row['runs_reaching_target']} reached its loss), gap {row['loss_gap_mean']:+.3f} ± "
            f"{row['loss_gap_std']:.3f}, {row['bytes_vs_ddp']:.3f} of DDP's bytes"
        )
    print(f"wrote {results / args.csv} and {summary_path}")
    return 0


def _format(row: dict) -> str:
    return (
        f"  {row['rate']:>8} r{row['repeat']} s{row['seed']} {row['method']:<13} final {row['final_train_loss']:.3f} "
        f"(gap {row['loss_gap']:+.3f}, val {row['final_val_loss']:.3f}) "
        f"to target {row['seconds_to_target']:.1f} s (x{row['ratio_to_ddp']:.2f} of DDP), to the common loss "
        f"{row['common_loss']:.3f} {row['seconds_to_common']:.1f} s (x{row['common_ratio_to_ddp']:.2f}), to the best "
        f"gossip loss {row['best_gossip_loss']:.3f} {row['seconds_to_best_gossip']:.1f} s "
        f"(x{row['best_gossip_ratio_to_ddp']:.2f}), "
        f"{row['mean_step_ms']:.0f} ms/step, {row['bytes_per_step'] / 1e3:.0f} kB/step"
    )


if __name__ == "__main__":
    sys.exit(main())
