"""The scaled-sign codec's computation in one gossip.ChocoSign step, against an earlier revision's, side by side.

Per edge and step a ChocoSign rank encodes its residual, decodes the message it sent (its own public copy moves by
it) and decodes the peer's. Since ``encode_signs`` returns the sender's decoding with the message, the current code
does one encode and one decode, with the codec objects reused from step to step as ``ChocoSign`` keeps them (one
per bucket); ``--baseline REV`` loads ``gossip/algorithms/scaled_sign.py`` as it was at git revision REV
(baseline_revision.py) and times that revision's step the same way where it has ``SignCodec``, else
``encode_signs`` and ``unpack_signs``, or ``pack_signs`` and two ``unpack_signs`` before ``encode_signs`` existed.
Both run on the same random residual, one thread, and the current message and decoding are checked to be the
baseline's bit for bit. Prints the median milliseconds (wall and process CPU) of ``--repeats`` steps, the two timed
in turn, for each number of levels (with ChocoSign's chunk for it) and the ratio.

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


def paired_medians(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each step's median wall and CPU time over ``repeats`` rounds, in milliseconds (``{name}_ms``,
    ``{name}_cpu_ms``): every round calls each step once, in turn, after one warm-up call each, so that a load that
    comes and goes falls on all of them alike."""
    for step in steps.values():
        step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start, used = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
    medians = {f"{name}_ms": 1e3 * statistics.median(times) for name, times in wall.items()}
    return medians | {f"{name}_cpu_ms": 1e3 * statistics.median(times) for name, times in cpu.items()}


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

    def functions_step() -> None:  # a revision without SignCodec: its own decoding from the encoder where it has one
        if hasattr(old, "encode_signs"):
            packed, _ = old.encode_signs(residual, chunk, levels)
        else:
            packed = old.pack_signs(residual, chunk, levels)
            old.unpack_signs(packed, numel, chunk)
        old.unpack_signs(packed, numel, chunk)

    def codec_step(sender, receiver) -> Callable[[], None]:  # as ChocoSign runs it: codecs reused every step
        def step() -> None:
            packed, _ = sender.encode(residual)
            receiver.decode(packed, numel)

        return step

    baseline_step = functions_step
    if hasattr(old, "SignCodec"):  # that revision's codecs, reused as the current ones are
        baseline_step = codec_step(old.SignCodec(chunk, levels), old.SignCodec(chunk, levels))
    current_step = codec_step(scaled_sign.SignCodec(chunk, levels), scaled_sign.SignCodec(chunk, levels))
    return paired_medians({"baseline": baseline_step, "current": current_step}, repeats) | {"identical": identical}


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
            f"{row['baseline_ms']:.2f} ms, now {row['current_ms']:.2f} ms ({ratio:.2f}x); CPU "
            f"{row['baseline_cpu_ms']:.2f} ms, now {row['current_cpu_ms']:.2f} ms "
            f"({row['current_cpu_ms'] / row['baseline_cpu_ms']:.2f}x), {result}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
