"""Properties of the default corpus, its train/validation split and per-worker batches (gossip/app/corpus.py)."""

import sysconfig
from itertools import islice
from pathlib import Path

import pytest
import torch

from gossip.app.corpus import (
    STDLIB_FILES,
    ShardedBatches,
    decode,
    encode,
    load_corpus,
    stdlib_corpus_bytes,
    validation_batches,
)
from gossip.errors import InvalidArgumentError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def random_data(length: int = 20_000, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_corpus_default_file_list_is_sorted_unique_and_present():
    assert list(STDLIB_FILES) == sorted(set(STDLIB_FILES))
    missing = [name for name in STDLIB_FILES if not (STDLIB / name).is_file()]
    assert missing == []


def test_corpus_default_is_the_listed_files_and_over_one_megabyte():
    text = stdlib_corpus_bytes()
    headers = sum(len(f"# ==== {name} ====\n") for name in STDLIB_FILES)
    separators = len(STDLIB_FILES) - 1
    assert len(text) == sum((STDLIB / name).stat().st_size for name in STDLIB_FILES) + headers + separators
    assert len(text) > 1_000_000
    assert (STDLIB / STDLIB_FILES[0]).read_bytes() in text


def test_corpus_default_loads_the_same_bytes_twice():
    first, second = load_corpus(), load_corpus()
    assert torch.equal(first.train, second.train)
    assert torch.equal(first.validation, second.validation)


def test_corpus_missing_default_file_raises_naming_it(tmp_path):
    absent = "json/decoder.py"
    for name in STDLIB_FILES:
        if name != absent:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text("pass\n")
    with pytest.raises(InvalidArgumentError, match=absent):
        stdlib_corpus_bytes(tmp_path)


def test_corpus_data_file_splits_into_train_then_last_tenth_as_validation(tmp_path):
    content = bytes(random_data(5_000).tolist())
    path = tmp_path / "text.txt"
    path.write_bytes(content)
    corpus = load_corpus(str(path))
    assert corpus.source == str(path)
    assert len(corpus.validation) == 500
    assert bytes(torch.cat([corpus.train, corpus.validation]).tolist()) == content


def test_corpus_missing_data_file_raises_naming_it(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"nothing\.txt"):
        load_corpus(str(tmp_path / "nothing.txt"))


def test_corpus_data_shorter_than_a_window_raises(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"x" * 64)
    with pytest.raises(ValueError, match="block_size"):
        load_corpus(str(path), block_size=64)


def test_corpus_encode_decode_round_trip():
    text = "def f(x):\n    return x ** 2  # é"
    assert decode(encode(text)) == text


def test_batches_are_shifted_windows_of_the_data_at_their_starts():
    data = random_data()
    batches = ShardedBatches(data, rank=0, world_size=2, batch_size=5, block_size=16, seed=1)
    x, y = batches.batch(3)
    assert x.shape == y.shape == (5, 16)
    assert x.dtype == y.dtype == torch.int64
    for row, start in enumerate(batches.window_starts(3).tolist()):
        assert torch.equal(x[row], data[start : start + 16].long())
        assert torch.equal(y[row], data[start + 1 : start + 17].long())


def test_batches_iid_differ_between_ranks_and_repeat_for_same_seed_rank_step():
    data = random_data()
    rank0 = ShardedBatches(data, rank=0, world_size=2, batch_size=4, block_size=16, seed=5)
    rank1 = ShardedBatches(data, rank=1, world_size=2, batch_size=4, block_size=16, seed=5)
    rank0_again = ShardedBatches(data, rank=0, world_size=2, batch_size=4, block_size=16, seed=5)
    assert not torch.equal(rank0.batch(0)[0], rank1.batch(0)[0])
    assert not torch.equal(rank0.batch(0)[0], rank0.batch(1)[0])
    assert torch.equal(rank0.batch(7)[0], rank0_again.batch(7)[0])


def test_batches_iid_starts_range_over_the_whole_train_set():
    data = random_data()
    batches = ShardedBatches(data, rank=0, world_size=4, batch_size=32, block_size=16)
    starts = torch.cat([batches.window_starts(step) for step in range(20)])
    assert starts.min() < len(data) // 4 and starts.max() >= 3 * len(data) // 4
    assert starts.max() <= len(data) - 17


def test_batches_noniid_come_only_from_own_contiguous_shard():
    data, world_size, block_size = random_data(10_001), 4, 16
    for rank in range(world_size):
        batches = ShardedBatches(data, rank, world_size, batch_size=32, block_size=block_size, split="noniid")
        low, high = rank * len(data) // world_size, (rank + 1) * len(data) // world_size
        starts = torch.cat([batches.window_starts(step) for step in range(20)])
        assert starts.min() >= low, rank
        assert starts.max() + block_size + 1 <= high, rank


def test_batches_resumed_at_step_k_equal_the_continued_run():
    data, k = random_data(), 6
    continued = ShardedBatches(data, rank=1, world_size=3, batch_size=4, block_size=16, seed=2, split="noniid")
    resumed = ShardedBatches(data, rank=1, world_size=3, batch_size=4, block_size=16, seed=2, split="noniid")
    continued_steps = list(islice(continued.iterate(), k + 3))[k:]
    resumed_steps = list(islice(resumed.iterate(start_step=k), 3))
    for (x_continued, y_continued), (x_resumed, y_resumed) in zip(continued_steps, resumed_steps, strict=True):
        assert torch.equal(x_continued, x_resumed)
        assert torch.equal(y_continued, y_resumed)


def test_batches_noniid_shard_shorter_than_a_window_raises_naming_rank():
    with pytest.raises(ValueError, match="rank 3"):
        ShardedBatches(random_data(60), rank=3, world_size=4, batch_size=2, block_size=16, split="noniid")


def test_batches_refuse_rank_outside_world():
    with pytest.raises(ValueError, match="rank 4"):
        ShardedBatches(random_data(), rank=4, world_size=4, batch_size=2, block_size=16)


def test_validation_batches_are_fixed_and_span_the_data():
    data = random_data(3_000)
    first = validation_batches(data, batch_size=4, block_size=16, num_batches=3)
    second = validation_batches(data, batch_size=4, block_size=16, num_batches=3)
    assert len(first) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second, strict=True))
    assert torch.equal(first[0][0][0], data[:16].long())
    assert torch.equal(first[-1][1][-1], data[-16:].long())
