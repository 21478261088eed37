"""The run directory of ``gossip-train``: its creation, and what rank 0 leaves in it at the end.

Contents of ``<out>/``:

* ``config.json`` -- the resolved configuration (world size, schedule, accum_iter, ... filled in);
* ``metrics_rank<r>.jsonl`` -- every rank's per-step metrics, written by the wrapper
  (see :mod:`gossip.wrapper.metrics`);
* ``tensorboard/rank<r>/`` -- the same metrics as TensorBoard scalars, when the tensorboard package is installed;
* ``summary.json`` -- the wrapper's traffic and timing summary over ranks;
* ``metrics.csv`` -- one row per step: rank 0's metrics plus ``mean_loss`` (the training loss averaged over
  ranks) and ``cumulative_bytes_sent`` (rank 0's payload bytes so far);
* ``result.json`` -- the numbers of the final summary table;
* ``loss_vs_step.png``, ``loss_vs_time.png``, ``loss_vs_bytes.png``, ``consensus_vs_step.png`` (matplotlib, Agg),
  titled with the run's configuration (:func:`plot_title`).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gossip.app.outer_options import describe_outer
from gossip.backends.base import Communicator
from gossip.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CSV_COLUMNS = (
    "step",
    "loss",
    "mean_loss",
    "val_loss",
    "lr",
    "consensus",
    "bytes_sent",
    "cumulative_bytes_sent",
    "elapsed_seconds",
    "step_seconds",
    "compute_seconds",
    "wait_seconds",
)
PLOTS = ("loss_vs_step.png", "loss_vs_time.png", "loss_vs_bytes.png", "consensus_vs_step.png")
FINAL_WINDOW = 10  # the final training loss is the mean over the last FINAL_WINDOW steps and all ranks


@dataclasses.dataclass
class RunSummary:
    """What rank 0 knows at the end of a run.

    Attributes:
        config: the resolved :class:`~gossip.app.train.TrainConfig`.
        losses_by_rank: every rank's training loss at every step.
        initial_val_loss: the averaged model's validation loss before training.
        final_val_loss: its validation loss at the end.
        consensus_distance: the exact consensus distance at the end.
        train_seconds: the wall time of the training loop.
        traffic: the wrapper's summary (bytes and times).
        sample: a text sample from the averaged model, or None.
    """

    config: Any  # gossip.app.train.TrainConfig
    losses_by_rank: list[list[float]]
    initial_val_loss: float
    final_val_loss: float
    consensus_distance: float
    train_seconds: float
    traffic: dict[str, float]
    sample: str | None

    @property
    def mean_losses(self) -> list[float]:
        """The training loss at every step, averaged over ranks."""
        return [sum(values) / len(values) for values in zip(*self.losses_by_rank, strict=True)]

    @property
    def initial_loss(self) -> float:
        """The mean training loss of the first step (NaN without steps)."""
        return self.mean_losses[0] if self.mean_losses else math.nan

    @property
    def final_loss(self) -> float:
        """The mean training loss over the last FINAL_WINDOW steps (NaN without steps)."""
        tail = self.mean_losses[-FINAL_WINDOW:]
        return sum(tail) / len(tail) if tail else math.nan

    def numbers(self) -> dict[str, float]:
        """The run's results as numbers, the content of ``result.json``.

        Returns:
            Losses, consensus distance, bytes per worker per step, times and tokens per second, by name.
        """
        steps = max(1, len(self.mean_losses))
        ranks = max(1, len(self.losses_by_rank))
        config = self.config
        tokens = ranks * config.batch_size * config.model["block_size"] * len(self.mean_losses)
        return {
            "initial_train_loss": self.initial_loss,
            "final_train_loss": self.final_loss,
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": self.final_val_loss,
            "consensus_distance": self.consensus_distance,
            "bytes_sent_per_worker_per_step": self.traffic.get("total_bytes_sent", math.nan) / ranks / steps,
            "mean_step_seconds": self.traffic.get("mean_step_seconds", math.nan),
            "mean_exposed_seconds": self.traffic.get("mean_exposed_seconds", math.nan),
            "exposed_fraction": self.traffic.get("exposed_fraction", math.nan),
            "train_seconds": self.train_seconds,
            "tokens_per_second": tokens / self.train_seconds if self.train_seconds > 0 else math.nan,
        }


def prepare_run_dir(config: Any, comm: Communicator) -> Path:
    """Agree on the run directory (``config.out``, default ``runs/<timestamp>``), create it and write ``config.json``.

    Rank 0 creates and writes; a collective.

    Args:
        config: the resolved config; its ``out`` is set to the directory.
        comm: this worker's communicator.

    Returns:
        The run directory.

    Raises:
        ConfigError: naming ``--out``, on every rank, when the directory already holds a run.
    """
    path, problem = None, None
    if comm.rank == 0:
        path = Path(config.out) if config.out else Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        if (path / "config.json").exists() or any(path.glob("metrics_rank*.jsonl")):
            problem = f"{str(path)!r} already holds a run; choose another directory"
        else:
            path.mkdir(parents=True, exist_ok=True)
            config.out = str(path)
            (path / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    path, problem = comm.all_gather_object((path, problem))[0]
    if problem is not None:
        raise ConfigError("--out", problem)
    config.out = str(path)
    return path


def _rows(run_dir: Path, summary: RunSummary) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics_rank0.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    mean_losses = summary.mean_losses
    cumulative = 0
    for row, mean_loss in zip(rows, mean_losses, strict=True):
        cumulative += row.get("bytes_sent", 0)
        row["mean_loss"] = mean_loss
        row["cumulative_bytes_sent"] = cumulative
    return rows


def write_metrics_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as a CSV file with the union of their keys as columns.

    Args:
        path: the file.
        rows: one dict per step.
    """
    extra = sorted({key for row in rows for key in row} - set(CSV_COLUMNS))
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[*CSV_COLUMNS, *extra], restval="")
        writer.writeheader()
        writer.writerows(rows)


def _smoothed(values: list[float], window: int = FINAL_WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def describe_mixing(config: Any) -> str:
    """How the run mixes, in words: every setting that tells two runs' mixing apart.

    E.g. "powergossip on one_peer_hypercube (rank 1, 4 power iterations), exact average every 16 steps" (DiLoCo's
    schedule is none of them).

    Args:
        config: a resolved config.

    Returns:
        The description.
    """
    if config.algorithm == "ddp":
        return "torch DDP (gradient all-reduce)"
    if config.algorithm == "diloco":
        if getattr(config, "outer_sync", None) in (None, "allreduce") and not getattr(config, "outer_delay", 0):
            return (
                f"diloco ({config.local_steps} local steps, outer Nesterov SGD lr {config.outer_lr:g} momentum "
                f"{config.outer_momentum:g})"
            )
        return f"diloco ({describe_outer(config)}) on {config.schedule}"
    mixing = f"{config.algorithm} on {config.schedule}"
    if config.algorithm == "powergossip":
        iterations = config.power_iterations or 1
        wire = getattr(config, "message_dtype", None)
        on_the_wire = f", {wire} messages" if wire not in (None, "float32") else ""
        delayed = ", the last applied a step later" if getattr(config, "delayed_last_iteration", False) else ""
        mixing += (
            f" (rank {config.rank}{f', {iterations} power iterations' if iterations > 1 else ''}{delayed}{on_the_wire})"
        )
    if config.average_every:
        mixing += f", exact average every {config.average_every} steps"
    if getattr(config, "outer_every", 0):
        mixing += f", {describe_outer(config)}"
    tracking = getattr(config, "gradient_tracking", False)
    if tracking:
        kind = "exact" if tracking is True else tracking
        overlapped = ", overlapped" if getattr(config, "tracking_overlap", False) else ""
        hops = getattr(config, "tracker_hops", None) or 1
        overlapped += f" ({hops} hops a step)" if hops > 1 else ""
        if getattr(config, "optimizer", None) == "momentum-tracking-adamw":
            mixing += f", {kind} trackers of the first moments{overlapped}"
            every = getattr(config, "second_moment_every", 0)
            if getattr(config, "second_moment", None) == "tracker":
                mixing += ", the mean gradient's second moment from the trackers"
            elif every:
                how = getattr(config, "mean_gradient", None) or "gossip"
                mixing += f", the mean gradient's second moment every {every} steps by {how}"
        else:
            mixing += f", {kind} gradient trackers{overlapped}"
    return mixing


def plot_title(config: Any) -> str:
    """The run's configuration in one line, the title of every plot (two runs' plots side by side stay apart).

    Args:
        config: a resolved config.

    Returns:
        The title.
    """
    return (
        f"{describe_mixing(config)}, {config.world_size} workers, {config.optimizer} lr {config.lr:g}, "
        f"{config.steps} steps x {config.batch_size}, {config.split}, seed {config.seed}"
    )


#: Fewest characters per line :func:`fit_titles` wraps a title to (a word longer than that stays whole).
MIN_TITLE_CHARS = 20


def fit_titles(figure: Figure) -> None:
    """Lay ``figure`` out (``tight_layout``) with every axes title inside the figure.

    A title wider than the figure is wrapped at word boundaries onto as few lines as fit (its words and their order
    unchanged). Each try wraps an overflowing title at 0.85 times its previous line length and lays the figure out
    again (the axes move to make room for the extra lines), until every title fits or its lines are
    :data:`MIN_TITLE_CHARS` characters long.

    Args:
        figure: a matplotlib figure.
    """
    titles = [(axis.title, axis.title.get_text()) for axis in figure.axes if axis.title.get_text()]
    chars = {id(title): len(text) for title, text in titles}
    while True:
        figure.tight_layout()
        figure.canvas.draw()
        bounds = figure.bbox
        overflowing = [
            (title, text)
            for title, text in titles
            if not (bounds.x0 <= title.get_window_extent().x0 and title.get_window_extent().x1 <= bounds.x1)
            and chars[id(title)] > MIN_TITLE_CHARS
        ]
        if not overflowing:
            return
        for title, text in overflowing:
            chars[id(title)] = max(MIN_TITLE_CHARS, int(0.85 * chars[id(title)]))
            title.set_text(textwrap.fill(text, chars[id(title)]))


def validation_curve(rows: list[dict[str, Any]], key: str, initial_val_loss: float) -> tuple[list[float], list[float]]:
    """(x, validation loss) from the first point on: the averaged model before training at x = 0, then each evaluation.

    On the step axis an evaluation after step s's update sits at s + 1 (updates applied so far).

    Args:
        rows: the metrics rows, some with ``val_loss``.
        key: the x axis: ``"step"`` or another column of the rows.
        initial_val_loss: the validation loss before training.

    Returns:
        The x values and the losses.
    """
    xs, ys = [0.0], [initial_val_loss]
    for row in rows:
        if "val_loss" in row:
            xs.append(row[key] + 1 if key == "step" else row[key])
            ys.append(row["val_loss"])
    return xs, ys


def write_plots(run_dir: Path, rows: list[dict[str, Any]], title: str = "", initial_val_loss: float = math.nan) -> None:
    """The four plots of :data:`PLOTS`, titled ``title``.

    Mean training loss (smoothed over FINAL_WINDOW steps) and validation loss (from ``initial_val_loss`` before
    training on) against step, wall clock and bytes sent; the sampled consensus distance against step (log scale).

    Args:
        run_dir: the run directory.
        rows: the metrics rows.
        title: the plots' title.
        initial_val_loss: the validation loss before training.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = _smoothed([row["mean_loss"] for row in rows])
    axes_of = {
        "loss_vs_step.png": ("step", "step", 1.0),
        "loss_vs_time.png": ("elapsed_seconds", "wall clock (s)", 1.0),
        "loss_vs_bytes.png": ("cumulative_bytes_sent", "MB sent per worker (rank 0)", 1e-6),
    }
    for name, (key, label, scale) in axes_of.items():
        figure, axis = plt.subplots(figsize=(7, 4.5))
        axis.plot([row[key] * scale for row in rows], loss, label="train loss (mean over ranks, smoothed)")
        xs, ys = validation_curve(rows, key, initial_val_loss)
        axis.plot([x * scale for x in xs], ys, "o-", label="validation loss (averaged model)")
        axis.set_title(title, fontsize=8)
        axis.set_xlabel(label)
        axis.set_ylabel("cross-entropy (nats / byte)")
        axis.grid(alpha=0.3)
        axis.legend()
        fit_titles(figure)
        figure.savefig(run_dir / name, dpi=100)
        plt.close(figure)
    measured = [row for row in rows if row.get("consensus") is not None]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    axis.plot([row["step"] for row in measured], [row["consensus"] for row in measured], ".-")
    axis.set_title(title, fontsize=8)
    if any(row["consensus"] > 0 for row in measured):
        axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.set_ylabel("consensus distance Ξ (sampled estimate)")
    axis.grid(alpha=0.3)
    fit_titles(figure)
    figure.savefig(run_dir / "consensus_vs_step.png", dpi=100)
    plt.close(figure)


def write_outputs(run_dir: Path, summary: RunSummary) -> None:
    """metrics.csv, result.json and the plots (rank 0, after the wrapper has closed its metrics file).

    Args:
        run_dir: the run directory.
        summary: the run's summary.
    """
    rows = _rows(run_dir, summary)
    write_metrics_csv(run_dir / "metrics.csv", rows)
    result = {**summary.numbers(), "sample": summary.sample}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    if rows:
        write_plots(run_dir, rows, plot_title(summary.config), summary.initial_val_loss)


def summary_table(summary: RunSummary) -> str:
    """The end-of-run table printed by rank 0.

    Args:
        summary: the run's summary.

    Returns:
        The table, as text.
    """
    numbers = summary.numbers()
    lines = [
        ("train loss (mean over ranks)", f"{numbers['initial_train_loss']:.3f} -> {numbers['final_train_loss']:.3f}"),
        ("val loss (averaged model)", f"{numbers['initial_val_loss']:.3f} -> {numbers['final_val_loss']:.3f}"),
        ("consensus distance (exact)", f"{numbers['consensus_distance']:.4g}"),
        ("bytes sent / worker / step", f"{numbers['bytes_sent_per_worker_per_step']:,.0f}"),
        ("mean step time", f"{numbers['mean_step_seconds'] * 1e3:.1f} ms"),
        (
            "exposed communication",
            f"{numbers['mean_exposed_seconds'] * 1e3:.2f} ms/step ({numbers['exposed_fraction']:.1%} of the step)",
        ),
        ("training time", f"{numbers['train_seconds']:.1f} s ({numbers['tokens_per_second']:,.0f} tokens/s)"),
        ("run directory", summary.config.out),
    ]
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in lines)
