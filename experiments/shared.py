"""Shared by the experiments: the CSV and plot helpers every study writes its results with, and the runner of the
smaller simulator studies (layer_selection, adaptive_rank): 4 workers train gossip.app.gpt's GPT on the stdlib corpus.

The workers are virtual ranks of ``gossip.simulate`` in this one process (the simulator is the oracle the real
backends match bit for bit), so losses and bytes are those of a real run; wall-clock times are of 4 threads
sharing this machine's cores, with no network cost -- they are reported, not used for claims about networks.
"""

from __future__ import annotations

import csv
import io
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

import gossip
import optim
import topologies
from gossip.app.corpus import ShardedBatches, load_corpus, validation_batches
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import TrainConfig, make_scheduler, train_step, validation_loss

WORKERS = 4
BATCH = 8
MODEL = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)  # small enough for 4 workers on 2 shared cores


def train_run(
    make_algorithm: Callable[[], gossip.Algorithm],
    *,
    steps: int,
    split: str = "iid",
    lr: float = 3e-3,
    eval_every: int = 25,
    seed: int = 0,
    schedule: Callable[[int], topologies.Schedule] = topologies.one_peer_hypercube,
    local_size: int | None = None,
    on_finish: Callable[[gossip.Algorithm], None] | None = None,
) -> list[dict]:
    """Train ``steps`` steps; return one row per evaluation: step, val loss, mean train loss, bytes, seconds.

    ``on_finish(algorithm)`` is called with rank 0's algorithm after the last step (e.g. to read its history).
    """
    corpus = load_corpus(None, block_size=MODEL.block_size)
    held_out = validation_batches(corpus.validation, BATCH, MODEL.block_size, 8)
    torch.set_num_threads(1)
    init_lock = threading.Lock()  # the virtual ranks are threads sharing torch's global generator

    def worker(comm: gossip.Communicator) -> list[dict]:
        with init_lock:  # seed + init atomically, else the ranks' draws interleave and rank 0's init is random
            torch.manual_seed(seed)
            module = GPT(MODEL)
        algorithm = make_algorithm()
        model = gossip.DecentralizedDataParallel(module, comm, schedule(comm.size), algorithm, seed=seed)
        groups = optim.param_groups(model.module, 0.1)
        optimizer = optim.AccumAdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, accum_iter=1)
        batches = ShardedBatches(corpus.train, comm.rank, comm.size, BATCH, MODEL.block_size, seed, split)
        rows, losses, started = [], [], time.perf_counter()
        # the main job's schedule: linear warm-up over 20 steps, cosine to lr / 10
        scheduler = make_scheduler(TrainConfig(lr=lr, steps=steps, warmup_steps=20), optimizer)
        for step in range(steps):
            losses.append(train_step(model, optimizer, batches.batch(step), scheduler))
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                elapsed = time.perf_counter() - started
                val = validation_loss(model, held_out, comm)
                sent = torch.tensor([float(algorithm.traffic.total_sent)], dtype=torch.float64)
                comm.all_reduce(sent, "avg")
                train = torch.tensor([sum(losses[-eval_every:]) / len(losses[-eval_every:])], dtype=torch.float64)
                comm.all_reduce(train, "avg")
                rank_now = getattr(algorithm, "rank", None)
                rows.append(
                    {"step": step + 1, "val_loss": val, "train_loss": float(train), "bytes_per_worker": float(sent),
                     "seconds": elapsed, "rank": rank_now}
                )  # fmt: skip
        if on_finish is not None and comm.rank == 0:
            on_finish(algorithm)
        model.close()
        return rows

    kwargs = {} if local_size is None else {"local_size": local_size}
    return gossip.simulate(WORKERS, worker, timeout=600.0, **kwargs)[0]


def first_reaching(rows: list[dict], target: float) -> dict | None:
    """The first evaluation row whose validation loss is at or below ``target``."""
    return next((row for row in rows if row["val_loss"] <= target), None)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` (all with the same keys) to the CSV at ``path``, writing the header when the file is new.

    Raises:
        ValueError: the file's header names other columns than the rows' keys (appending would shift them).
    """
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as handle:
            header = next(csv.reader(handle), [])
        if header != list(rows[0]):
            raise ValueError(
                f"{path}: its columns {header} are not the rows' {list(rows[0])}; write to a new file (--out) or "
                "add the missing columns to it first"
            )
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV written by ``write_csv``; numeric fields as float, empty ones as None."""

    def value(text: str):
        if text == "":
            return None
        try:
            return float(text)
        except ValueError:
            return text

    with path.open(newline="") as handle:
        return [{key: value(text) for key, text in row.items()} for row in csv.DictReader(handle)]


def save_figure(fig, path: Path, max_bytes: int = 200_000) -> Path:
    """Save a matplotlib figure as PNG (dpi 100) in 256 colours (a palette PNG: a fraction of the bytes of full
    colour for lines and text), laid out with every title inside it (:func:`gossip.app.run_dir.fit_titles`), and
    check it stays under ``max_bytes``."""
    import matplotlib.pyplot as plt
    from PIL import Image

    from gossip.app.run_dir import fit_titles

    fit_titles(fig)
    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=100)
    plt.close(fig)
    with Image.open(rendered) as image:
        image.convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path}: {size} bytes is over the {max_bytes}-byte budget for a plot")
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
