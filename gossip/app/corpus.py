"""Training text for `gossip-train`: a built-in byte corpus, a train/validation split, per-worker batches.

The default corpus needs no download: it is the source of a fixed list of pure-Python standard-library
modules (`STDLIB_FILES`), found under `sysconfig.get_paths()["stdlib"]` and concatenated in sorted order,
each preceded by a one-line header naming it. The files exist, at these paths, in every CPython >= 3.10
(modules later turned into packages, such as zipfile or pathlib, are left out). Their contents differ a
little between Python versions, so the corpus length is a property of the machine, not a constant. A missing
file is an error naming it: the job never silently trains on other data. `load_corpus(path)` reads any file
instead.

Batches (`ShardedBatches`): worker `rank` of `world_size` draws windows of block_size + 1 bytes;
x = window[:-1], y = window[1:].

- "iid": window starts are uniform over the whole training set, so every worker sees the same distribution.
- "noniid": the training set is cut into world_size contiguous shards and worker r draws only from shard r,
  ``[r * N // world_size, (r + 1) * N // world_size)``. Shards hold different source files, so the workers'
  byte statistics differ (the decentralized-data setting of PowerGossip's LSTM experiment, docs/design.md A.10).

Every batch is drawn by its own generator, seeded by (seed, rank, step) through numpy's SeedSequence. A batch
is therefore a pure function of (seed, rank, step): resuming at step k means calling `batch(k)`; there is no
generator state to save, restore or replay.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gossip.errors import InvalidArgumentError

STDLIB_FILES: tuple[str, ...] = (
    "argparse.py",
    "ast.py",
    "asyncio/base_events.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "dataclasses.py",
    "difflib.py",
    "email/message.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "http/client.py",
    "http/server.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "logging/__init__.py",
    "mailbox.py",
    "os.py",
    "pickle.py",
    "random.py",
    "shutil.py",
    "smtplib.py",
    "statistics.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "xml/dom/minidom.py",
)

SPLITS = ("iid", "noniid")


@dataclass(frozen=True)
class Corpus:
    """Bytes as uint8 tensors: train is the first (1 - val_fraction) of the text, validation the rest.

    Attributes:
        train: the training bytes.
        validation: the validation bytes.
        source: where the text came from (the file, or the built-in corpus).
    """

    train: torch.Tensor
    validation: torch.Tensor
    source: str


def stdlib_corpus_bytes(stdlib_dir: str | Path | None = None) -> bytes:
    """The default corpus: the files of STDLIB_FILES under stdlib_dir, concatenated with a header each.

    Args:
        stdlib_dir: the standard library's directory (default: this Python's).

    Returns:
        The corpus bytes.

    Raises:
        InvalidArgumentError: a file of STDLIB_FILES is missing (pass a text file with ``--data`` instead).
    """
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    parts = []
    for name in STDLIB_FILES:
        path = root / name
        if not path.is_file():
            raise InvalidArgumentError(
                f"default corpus file {name!r} not found at {path}; this Python's standard library "
                "is incomplete, pass a text file with --data instead"
            )
        parts.append(f"# ==== {name} ====\n".encode() + path.read_bytes())
    return b"\n".join(parts)


def load_corpus(path: str | None = None, block_size: int = 64, val_fraction: float = 0.1) -> Corpus:
    """Read path (or the built-in stdlib corpus if None) and split off the last val_fraction as validation.

    Both splits must hold at least one window of block_size + 1 bytes.

    Args:
        path: the text file, or None for the built-in corpus.
        block_size: the model's context length.
        val_fraction: the share of the text held out for validation, in (0, 1).

    Returns:
        The corpus.

    Raises:
        InvalidArgumentError: the file is missing or empty, ``val_fraction`` is out of range, or a split is shorter
            than a window.
    """
    if not 0.0 < val_fraction < 1.0:
        raise InvalidArgumentError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if path is None:
        text, source = stdlib_corpus_bytes(), "python-stdlib"
    else:
        if not Path(path).is_file():
            raise InvalidArgumentError(f"--data file {path!r} does not exist or is not a file")
        text, source = Path(path).read_bytes(), path
        if not text:
            raise InvalidArgumentError(f"--data file {path!r} is empty; give a text file to train on")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    num_validation = int(len(data) * val_fraction)
    split_at = len(data) - num_validation
    corpus = Corpus(train=data[:split_at], validation=data[split_at:], source=source)
    for split_name, split in (("train", corpus.train), ("validation", corpus.validation)):
        if len(split) < block_size + 1:
            raise InvalidArgumentError(
                f"corpus {source!r} has {len(data)} bytes; its {split_name} split ({len(split)} bytes) is "
                f"shorter than block_size + 1 = {block_size + 1}; use a larger file or a smaller block_size"
            )
    return corpus


def encode(text: str) -> torch.Tensor:
    """Byte tokens of a string's UTF-8 encoding.

    Args:
        text: the string.

    Returns:
        An int64 tensor of shape (len,).
    """
    return torch.tensor(list(text.encode()), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """The string of byte tokens; bytes that are not valid UTF-8 become U+FFFD.

    Args:
        tokens: byte tokens.

    Returns:
        The string.
    """
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def _windows(data: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x = data[s : s + block_size], y = data[s + 1 : s + block_size + 1] for each start s, as int64."""
    windows = data[starts[:, None] + torch.arange(block_size + 1)].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ShardedBatches:
    """Training batches of worker `rank`: (x, y) int64 tensors of shape (batch_size, block_size).

    `batch(step)` is a pure function of (seed, rank, step) (see the module docstring); `iterate(start_step)`
    yields batch(start_step), batch(start_step + 1), ... for a resumed run.

    Args:
        data: the training bytes.
        rank: this worker, in [0, world_size).
        world_size: the number of workers.
        batch_size: sequences per batch (>= 1).
        block_size: the length of a sequence (>= 1).
        seed: the seed of the windows (>= 0).
        split: how the data is shared between workers, one of SPLITS.

    Raises:
        InvalidArgumentError: an argument is out of range, or a worker's shard is shorter than a window.
    """

    def __init__(
        self,
        data: torch.Tensor,
        rank: int,
        world_size: int,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        split: str = "iid",
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or block_size < 1:
            raise InvalidArgumentError(f"batch_size and block_size must be >= 1, got {batch_size} and {block_size}")
        if seed < 0:
            raise InvalidArgumentError(f"seed must be >= 0, got {seed}")
        if split not in SPLITS:
            raise InvalidArgumentError(f"split must be one of {SPLITS}, got {split!r}")
        self.data, self.rank, self.seed = data, rank, seed
        self.batch_size, self.block_size = batch_size, block_size
        if split == "iid":
            self.shard = (0, len(data))
        else:
            self.shard = (rank * len(data) // world_size, (rank + 1) * len(data) // world_size)
        shard_length = self.shard[1] - self.shard[0]
        if shard_length < block_size + 1:
            raise InvalidArgumentError(
                f"rank {rank}: its {split} shard of the training data has {shard_length} bytes, fewer than "
                f"block_size + 1 = {block_size + 1}; use more data, fewer workers or a smaller block_size"
            )

    def window_starts(self, step: int) -> torch.Tensor:
        """Offsets into data of the batch_size windows of `step`, uniform over this worker's shard.

        Args:
            step: the training step (>= 0).

        Returns:
            The offsets, an int64 tensor of shape (batch_size,).

        Raises:
            InvalidArgumentError: ``step`` is negative.
        """
        if step < 0:
            raise InvalidArgumentError(f"rank {self.rank}: step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, self.rank, step])
        low, high = self.shard[0], self.shard[1] - self.block_size  # last start leaves room for y
        return torch.from_numpy(rng.integers(low, high, size=self.batch_size))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (x, y) batch of training step `step`.

        Args:
            step: the training step (>= 0).

        Returns:
            Inputs and targets (the inputs shifted by one byte).
        """
        return _windows(self.data, self.window_starts(step), self.block_size)

    def iterate(self, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of steps start_step, start_step + 1, ... without end.

        Args:
            start_step: the first step.

        Yields:
            The (x, y) batch of each step.
        """
        step = start_step
        while True:
            yield self.batch(step)
            step += 1


def validation_batches(
    data: torch.Tensor, batch_size: int, block_size: int, num_batches: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed evaluation set: num_batches * batch_size windows at evenly spaced offsets over data.

    No randomness, so every worker and every evaluation sees the same windows.

    Args:
        data: the validation bytes.
        batch_size: sequences per batch.
        block_size: the length of a sequence.
        num_batches: the number of batches.

    Returns:
        The (x, y) batches.

    Raises:
        InvalidArgumentError: ``data`` is shorter than one window.
    """
    if len(data) < block_size + 1:
        raise InvalidArgumentError(
            f"validation data has {len(data)} bytes, fewer than block_size + 1 = {block_size + 1}"
        )
    starts = torch.linspace(0, len(data) - block_size - 1, num_batches * batch_size).long()
    return [_windows(data, chunk, block_size) for chunk in starts.split(batch_size)]
