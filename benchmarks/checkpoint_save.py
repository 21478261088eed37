"""Peak memory and training time that a checkpoint save costs: the previous save (the whole state serialised into an
``io.BytesIO``, then written), the streamed save, and the asynchronous one, side by side.

Each variant runs in a fresh process (so that its peak RSS is its own): 2 simulated ranks (threads) train a
stack of ``--layers`` bias-free ``--width`` x ``--width`` linear layers with AdamW, save once after step
``--save-at``, train ``--after`` more steps, then wait for the save (asynchronous variant). A thread samples the
process's resident set size (``/proc/self/statm``) every millisecond.

Reported per variant (the process holds both ranks):

* ``rss before``: the resident set before the save; ``peak in save``: the highest sample from the save call to the
  end of its write (for the asynchronous save: to the end of ``wait()``, training steps included);
  ``extra``: their difference; ``peak train``: the highest sample during the steps before the save (gradients
  and optimizer temporaries), for comparison;
* ``save call``: how long the save call blocked training; ``lost``: the wall time from the save call to the end of
  the steps after it (and ``wait()``) minus those steps at the median speed of the steps before the save.

Usage: ``python benchmarks/checkpoint_save.py [--variants previous,stream,async] [--repeats 1]``; the previous
implementation is ``gossip/checkpoint.py`` at ``--baseline`` (a git revision, loaded by baseline_revision.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * PAGE


class Sampler(threading.Thread):
    """The resident set size every millisecond; ``peak_since(mark)`` is the highest sample after ``mark()``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    def mark(self) -> None:
        self.peak = rss()

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)


def child(variant: str, args: argparse.Namespace, directory: Path) -> dict:
    import torch
    from torch import nn

    import gossip
    import topologies
    from gossip.algorithms.exact import ExactGossip
    from gossip.wrapper.parallel import DecentralizedDataParallel

    sys.path.insert(0, str(REPO / "benchmarks"))
    if variant == "previous":
        from baseline_revision import module_at_revision

        save = module_at_revision("gossip/checkpoint.py", args.baseline, "checkpoint_previous").save_checkpoint
    else:
        save = gossip.save_checkpoint
    torch.set_num_threads(1)  # one core per simulated rank
    sampler = Sampler()
    sampler.start()
    out: dict = {"variant": variant}
    barrier = threading.Barrier(2)

    def rank(comm) -> None:
        torch.manual_seed(comm.rank)
        module = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
        model = DecentralizedDataParallel(module, comm, topologies.one_peer_hypercube(2), ExactGossip())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        x = torch.randn(4, args.width)
        steps, future = [], None
        for step in range(args.save_at + 1 + args.after):
            if step == args.save_at + 1:
                barrier.wait()
                if comm.rank == 0:
                    out["rss_before"] = rss()
                    out["peak_train"] = sampler.peak
                    sampler.mark()
                barrier.wait()
                start = time.perf_counter()
                kwargs = {"async_save": True} if variant == "async" else {}
                future = save(directory, model, optimizer, **kwargs)
                call = time.perf_counter() - start
            began = time.perf_counter()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append(time.perf_counter() - began)
        if variant == "async":
            future.wait()
        end = time.perf_counter()
        barrier.wait()
        if comm.rank == 0:
            baseline = statistics.median(steps[1 : args.save_at + 1])  # step 0 warms up
            out.update(
                peak_save=sampler.peak,
                step_seconds=baseline,
                save_call_seconds=call,
                lost_seconds=(end - start) - args.after * baseline,
                parameters=sum(p.numel() for p in module.parameters()),
                file_bytes=(directory / "rank0.pt").stat().st_size,
            )
        model.close()

    gossip.simulate(2, rank, timeout=600.0)
    sampler.running = False
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="previous,stream,async")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)  # 6 x 4096^2 = 100.7 M parameters per rank
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--baseline", default="924acbc", help="git revision of the previous checkpoint.py")
    parser.add_argument("--directory", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory = Path(args.directory)
        print(json.dumps(child(args.child, args, directory)))
        return
    rows = []
    for _ in range(args.repeats):
        for variant in args.variants.split(","):
            directory = Path(tempfile.mkdtemp(dir=args.directory, prefix=f"ckpt-{variant}-"))
            try:
                command = [sys.executable, __file__, "--child", variant, "--directory", str(directory)]
                command += ["--width", str(args.width), "--layers", str(args.layers), "--save-at", str(args.save_at)]
                command += ["--after", str(args.after), "--baseline", args.baseline]
                result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            row = json.loads(result.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    gib = 2**30
    print(f"\n{rows[0]['parameters'] / 1e6:.1f} M parameters per rank, 2 ranks in the process, AdamW; "
          f"file {rows[0]['file_bytes'] / gib:.2f} GiB per rank")  # fmt: skip
    print("| variant | rss before | peak in save | extra | peak train | step | save call | lost |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['rss_before'] / gib:.2f} GiB | {row['peak_save'] / gib:.2f} GiB | "
            f"{(row['peak_save'] - row['rss_before']) / gib:.2f} GiB | {row['peak_train'] / gib:.2f} GiB | "
            f"{row['step_seconds']:.2f} s | {row['save_call_seconds']:.2f} s | {row['lost_seconds']:.2f} s |"
        )


if __name__ == "__main__":
    main()
