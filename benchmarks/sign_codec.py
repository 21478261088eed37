"""The scaled-sign codec's computation in one gossip.ChocoSign step, against an earlier revision's, side by side.

Per edge and step a ChocoSign rank encodes its residual, decodes the message it sent (its own public copy moves by
it) and decodes the peer's. Since ``encode_signs`` returns the sender's decoding with the message, the current code
does one encode and one decode, with the codec objects reused from step to step as ``ChocoSign`` keeps them (one
per bucket); ``--baseline REV`` loads ``gossip/algorithms/scaled_sign.py`` as it was at git
revision REV (baseline_revision.py) and times that revision's step: ``encode_signs`` and ``unpack_signs``, or
``pack_signs`` and two ``unpack_signs`` before ``encode_signs`` existed. Both
run on the same random residual, one thread, and the current message and decoding are checked to be the
baseline's bit for bit. Prints the median milliseconds of ``--repeats`` steps for each number of levels (with
ChocoSign's chunk for it) and the ratio.

    python benchmarks/sign_codec.py                      # the main job's GPT (437,760 parameters)
    python benchmarks/sign_codec.py --numel 124000000    # GPT-2 small's size
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_revision import module_at_revision

from gossip.algorithms import scaled_sign

#: Levels and the chunk the study and gossip.ChocoSign use with them.
CODES = {1: 128, 2: 128, 4: 256}


def median_ms(step: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``step`` after one warm-up call, in milliseconds."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def compare(old, residual: torch.Tensor, chunk: int, levels: int, repeats: int) -> dict[str, float | bool]:
    """One level setting: the baseline's and the current step's times, and whether their results are identical."""
    numel = residual.numel()
    message, sent = scaled_sign.encode_signs(residual, chunk, levels)
    before = old.pack_signs(residual, chunk, levels)
    identical = len(message) == len(before) and all(torch.equal(a, b) for a, b in zip(message, before, strict=True))
    decoded = old.unpack_signs(before, numel, chunk)
    identical = identical and torch.equal(sent, decoded) and torch.equal(sent.signbit(), decoded.signbit())
    identical = identical and torch.equal(scaled_sign.unpack_signs(message, numel, chunk), decoded)
    reused = scaled_sign.SignCodec(chunk, levels)
    for _ in range(2):  # the second call runs on the first one's buffers
        again, values = reused.encode(residual)
        identical = identical and all(torch.equal(a, b) for a, b in zip(again, message, strict=True))
        identical = identical and torch.equal(values, sent) and torch.equal(reused.decode(again, numel), decoded)

    def baseline_step() -> None:  # that revision's ChocoSign step: its own decoding from the encoder where it has one
        if hasattr(old, "encode_signs"):
            packed, _ = old.encode_signs(residual, chunk, levels)
        else:
            packed = old.pack_signs(residual, chunk, levels)
            old.unpack_signs(packed, numel, chunk)
        old.unpack_signs(packed, numel, chunk)

    sender, receiver = scaled_sign.SignCodec(chunk, levels), scaled_sign.SignCodec(chunk, levels)

    def current_step() -> None:  # as ChocoSign runs it: a codec per bucket and side, reused every step
        packed, _ = sender.encode(residual)
        receiver.decode(packed, numel)

    return {
        "baseline_ms": median_ms(baseline_step, repeats),
        "current_ms": median_ms(current_step, repeats),
        "identical": identical,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=437_760, help="values per step (default: the main job's GPT)")
    parser.add_argument("--baseline", default="c5f33e2", help="the git revision to compare with")
    parser.add_argument("--baseline-file", help="the baseline module's file instead (no git history needed)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--levels", type=int, nargs="+", default=list(CODES), choices=list(CODES))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    old = module_at_revision(
        "gossip/algorithms/scaled_sign.py", args.baseline, "scaled_sign_baseline", args.baseline_file
    )
    residual = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for levels in args.levels:
        row = {"levels": levels, "chunk": CODES[levels], **compare(old, residual, CODES[levels], levels, args.repeats)}
        rows.append(row)
        ratio = row["current_ms"] / row["baseline_ms"]
        result = "bit-identical" if row["identical"] else "DIFFERENT RESULTS"
        print(
            f"levels {levels}, chunk {row['chunk']}, {args.numel:,} values: {args.baseline_file or args.baseline} "
            f"{row['baseline_ms']:.1f} ms, now {row['current_ms']:.1f} ms ({ratio:.2f}x), {result}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
