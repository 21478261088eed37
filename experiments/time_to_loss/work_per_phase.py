r"""How much work each phase of the main job's step does, counted rather than timed, and how two revisions differ.

Timings taken on a machine whose cores are all busy (the emulated hosts of this study share two cores) move with
the load, so "did this change add work to the step, and where" is answered here by counting: on rank 0 of a
main-job run on the simulator (``gossip.simulate``, one thread per rank), the aten operations (a
``TorchDispatchMode``) and the Python function calls (``sys.setprofile``) of every step after ``--skip``, per phase:

* ``forward+backward``: the model's forward and backward, and reading the loss; with ``progress`` and ``posting``,
  the wrapper's ``compute_seconds``;
* ``progress``: what the backward hooks run of the step's exchange (``DecentralizedDataParallel._progress``:
  PowerGossip's further power iterations, each once the exchange before it has arrived);
* ``finish``: ``algorithm.finish`` (``finish_seconds``: the wait and the mixing arithmetic);
* ``update``: the rest of ``optimizer.step()`` and ``zero_grad()``, the optimizer's own work;
* ``posting``: ``DecentralizedDataParallel._start``, posting the next step's exchange (with the snapshot of the
  algorithm's state that a checkpoint taken during the step holds);
* ``metrics``: the rest of ``next_step`` (the step's metrics row);
* ``loop``: the training loop's own work between two steps (the batch, ``model.log``, the scheduler).

The operations of a revision do not depend on the machine's load: two runs of the same code count the same ones,
except how ``progress`` and ``finish`` share the exchange's iterations, which depends on when the peer's messages
arrive (an iteration run early works on a copy of the parameters, so the two phases' sum moves too).
The simulator does a collective's arithmetic for every rank (an all-reduce's sum) in the thread of the rank that
arrives last; that shared work is never counted, so a phase with a collective (an averaging step's ``finish``, the
consensus estimate and schedule check in ``metrics``) counts the same whether rank 0 came last or not. The Python
calls nearly so, except where timing decides: a wait's polling in ``finish``, the progress bar's refreshes in ``loop``.
``--against REV [REV ...]`` runs the same count on a git worktree of each REV (this file, run with that tree first on
the path) and prints them beside this tree's.

    python -m experiments.time_to_loss.work_per_phase --ranks 8 --steps 40 --against e725991 -- \
        --batch-size 8 --outer-every 10

Everything after ``--`` goes to the main job (``gossip-train``'s options; ``--steps`` and ``--out`` are set here).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

import gossip
import gossip.app.train as train
from gossip.app.cli import build_parser, config_from

PHASES = ("forward+backward", "progress", "finish", "update", "posting", "metrics", "loop")


class _Counts:
    """Rank 0's operations and Python calls per phase, counted between two step numbers."""

    def __init__(self) -> None:
        self.phase = "loop"
        self.counting = False
        self.ops: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def inside(self, phase: str) -> Iterator[None]:
        outer, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = outer

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Count what ``owner.name(...)`` does under ``phase`` (an instance attribute shadowing the method)."""
        method = getattr(owner, name)

        @functools.wraps(method)  # with its attributes (the LR scheduler checks the one it set on optimizer.step)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.inside(phase):
                return method(*args, **kwargs)

        setattr(owner, name, counted)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

    def leave_out_collective_sums(self, comm: Any) -> None:
        """Count none of the arithmetic that ``comm`` (a simulator rank) does for every rank of a collective.

        The simulator combines a collective's payloads (an all-reduce's sum) in the thread of the rank that arrives
        last, with the ``combine`` that rank passed: wrapping this rank's ``combine`` pauses counting exactly when
        this rank does that shared work, so that whether it came last does not change its counts.
        """
        collective = comm._collective

        def collective_uncounted_sum(kind: str, payload: Any, combine: Callable[[list[Any]], Any]) -> Any:
            def combine_uncounted(parts: list[Any]) -> Any:
                with self.paused():
                    return combine(parts)

            return collective(kind, payload, combine_uncounted)

        comm._collective = collective_uncounted_sum

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and self.counting:
            self.calls[self.phase] += 1


class _Operations(TorchDispatchMode):
    """Count every aten operation of the thread that enters it into ``counts``, under its current phase."""

    def __init__(self, counts: _Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counts.counting:
            self.counts.ops[self.counts.phase] += 1
        return func(*args, **(kwargs or {}))


def count(ranks: int, steps: int, skip: int, options: Sequence[str], out: str) -> dict[str, Any]:
    """Run the main job with ``options`` on ``ranks`` simulated ranks for ``steps`` steps; rank 0's counts per step
    (over steps ``skip`` .. ``steps`` - 1) per phase, and where ``gossip`` was imported from."""
    counts = _Counts()
    original_step: Callable[..., float] = train.train_step
    wrapped = False

    def counted_step(model: Any, optimizer: Any, batch: Any, scheduler: Any) -> float:
        """The main job's own step, its phases marked by wrapping what it calls on rank 0."""
        nonlocal wrapped
        if model.comm.rank != 0:
            return original_step(model, optimizer, batch, scheduler)
        if not wrapped:
            wrapped = True
            counts.wrap(model, "_start", "posting")
            counts.wrap(model, "_progress", "progress")
            counts.wrap(model, "next_step", "metrics")
            counts.wrap(model.algorithm, "finish", "finish")
            counts.wrap(optimizer, "step", "update")
            counts.wrap(optimizer, "zero_grad", "update")
            counts.wrap(scheduler, "step", "loop")
        counts.counting = skip <= model.step_count < steps
        with counts.inside("forward+backward"):
            value = original_step(model, optimizer, batch, scheduler)
        counts.counting = skip <= model.step_count < steps  # the loop after the last step (validation, sample): not
        return value

    def worker(comm: Any) -> None:
        if comm.rank != 0:
            train._train(config, comm)
            return
        counts.leave_out_collective_sums(comm)
        sys.setprofile(counts.profile)  # this thread's only
        try:
            with _Operations(counts):  # this thread's only
                train._train(config, comm)
        finally:
            sys.setprofile(None)

    config = config_from(build_parser().parse_args([*options, "--steps", str(steps), "--out", out]))
    train.train_step = counted_step
    try:
        gossip.simulate(ranks, worker)
    finally:
        train.train_step = original_step
    measured = steps - skip
    return {
        "gossip": str(Path(gossip.__file__).resolve().parent.parent),
        "steps": measured,
        "ops": {phase: counts.ops[phase] / measured for phase in PHASES},
        "calls": {phase: counts.calls[phase] / measured for phase in PHASES},
    }


def count_at(revision: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`count` on a temporary git worktree of ``revision``: this file run with that tree first on the path."""
    repository = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="work_per_phase_") as scratch:
        tree = Path(scratch) / "tree"
        git = ["git", "-C", str(repository)]
        subprocess.run([*git, "worktree", "add", "--detach", "--quiet", str(tree), revision], check=True)
        try:
            command = [sys.executable, str(Path(__file__).resolve()), *_count_options(args), "--json", "--"]
            done = subprocess.run(
                [*command, *args.options],
                cwd=tree,
                env={**_environment(), "PYTHONPATH": str(tree)},
                capture_output=True,
                text=True,
                check=False,
            )
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=True)
        if done.returncode != 0:
            raise SystemExit(f"work_per_phase at {revision} failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if Path(result["gossip"]).resolve() != tree.resolve():
            raise SystemExit(f"work_per_phase at {revision} imported gossip from {result['gossip']}, not the worktree")
        result["gossip"] = f"{revision} (worktree)"
        return result


def _environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def _count_options(args: argparse.Namespace) -> list[str]:
    return ["--ranks", str(args.ranks), "--steps", str(args.steps), "--skip", str(args.skip)]


def table(results: dict[str, dict[str, Any]]) -> str:
    """Operations, then Python calls, per step: one line per phase and the whole step, one column per result, and
    the last column's difference to the first."""
    names = list(results)
    width = max(14, *(len(name) for name in names))
    lines = []
    for kind, title in (("ops", "aten operations per step"), ("calls", "Python calls per step")):
        header = f"{title:<26}" + "".join(f" {name:>{width}}" for name in names)
        lines.append(header + (f" {'last - first':>{width}}" if len(names) > 1 else ""))
        for phase in (*PHASES, "step"):
            values = [
                sum(results[name][kind].values()) if phase == "step" else results[name][kind][phase] for name in names
            ]
            line = f"  {phase:<24}" + "".join(f" {value:>{width}.1f}" for value in values)
            lines.append(line + (f" {values[-1] - values[0]:>+{width}.1f}" if len(names) > 1 else ""))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="simulated ranks (default: 8)")
    parser.add_argument("--steps", type=int, default=40, help="steps of the run (default: 40)")
    parser.add_argument("--skip", type=int, default=10, help="first steps not counted (default: 10)")
    parser.add_argument("--against", nargs="+", default=[], metavar="REV", help="also count at these git revisions")
    parser.add_argument("--json", action="store_true", help="print this tree's counts as one JSON line")
    parser.add_argument("options", nargs="*", help="the main job's options (after --)")
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.steps:
        parser.error(f"--skip must be in [0, --steps), got {args.skip} with --steps {args.steps}")
    results = {revision: count_at(revision, args) for revision in args.against}
    with tempfile.TemporaryDirectory(prefix="work_per_phase_run_") as out:
        here = count(args.ranks, args.steps, args.skip, args.options, str(Path(out) / "run"))
    if args.json:
        print(json.dumps(here))
        return 0
    results["this tree"] = here
    print(f"rank 0 of {args.ranks} simulated ranks, per step over steps {args.skip}-{args.steps - 1}; main job: "
          f"{' '.join(args.options) or '(defaults)'}")  # fmt: skip
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
