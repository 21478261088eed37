"""Per-step metrics of one rank, written as JSON lines, and their summary over ranks.

One line per optimizer step in ``<run_dir>/metrics_rank<r>.jsonl`` with:

* ``step``, ``lr`` (the optimizer's first param group), and whatever the user passed to ``model.log(...)``
  for the step (e.g. ``loss``), before its ``optimizer.step()`` or after it but before the next forward;
* ``consensus`` -- the sampled estimate of the consensus distance Xi (docs/design.md F.4 method 2), on the steps
  where it is due (``consensus_every``), else absent;
* ``bytes_sent`` / ``bytes_received`` -- payload bytes of this step's exchange (``algorithm.traffic.last_*``);
* ``wait_seconds`` -- exposed communication: the algorithm's ``wait_seconds``, time blocked in ``finish``;
* ``finish_seconds`` -- wall time of ``algorithm.finish`` (the wait plus the mixing arithmetic);
* ``compute_seconds`` -- wall time between the start of the exchange and the optimizer step (forward + backward,
  plus anything else the loop does there, e.g. loading the batch);
* ``step_seconds`` -- wall time from the end of the previous optimizer step to the end of this one.

Recording costs no communication; only the summary at ``close`` gathers one small dict per rank.

When the ``tensorboard`` package is installed (``pip install 'gossip-train[tensorboard]'``), every numeric value of
a row is also written as a TensorBoard scalar (``torch.utils.tensorboard``) under ``<run_dir>/tensorboard/rank<r>``,
one run per rank: ``tensorboard --logdir <run_dir>/tensorboard`` overlays the ranks. Without it, nothing changes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from gossip.backends.base import Communicator

logger = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"


def tensorboard_available() -> bool:
    """Whether the tensorboard package is installed (the metrics then also go to TensorBoard).

    Returns:
        True when ``tensorboard`` can be imported.
    """
    return importlib.util.find_spec("tensorboard") is not None


def _tensorboard_writer(run_dir: Path, rank: int) -> Any:
    """A SummaryWriter for this rank's scalars, or None when the tensorboard package is not installed."""
    if not tensorboard_available():
        return None
    from torch.utils.tensorboard import SummaryWriter

    log_dir = run_dir / TENSORBOARD_DIR / f"rank{rank}"
    logger.debug("rank %d: TensorBoard scalars in %s", rank, log_dir)
    return SummaryWriter(log_dir=str(log_dir))


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().float().item() if value.numel() == 1 else value.detach().tolist()
    return value


@dataclasses.dataclass
class _Totals:
    steps: int = 0
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    finish_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


class StepMetrics:
    """Collects one row per step; writes it when ``run_dir`` is set; keeps running totals either way.

    Args:
        run_dir: the directory of ``metrics_rank<r>.jsonl`` (and ``summary.json`` on rank 0), or None to write nothing.
        rank: this rank.
    """

    def __init__(self, run_dir: str | Path | None, rank: int):
        self.rank = rank
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.last: dict[str, Any] = {}
        self._extra: dict[str, Any] = {}
        self._held: dict[str, Any] | None = None
        self._totals = _Totals()
        self._file = None
        self._tensorboard = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / f"metrics_rank{rank}.jsonl", "a")  # noqa: SIM115 -- closed in close()
            self._tensorboard = _tensorboard_writer(self.run_dir, rank)

    def note(self, **values: Any) -> None:
        """Values for a step's row.

        Logged before ``optimizer.step()`` they belong to that step; logged after it, before the next forward, to the
        step just finished (its row is held until then).

        Args:
            **values: the row's entries (e.g. ``loss=loss``); a one-element tensor is written as a number.
        """
        if self._held is not None:
            self._held.update({key: _plain(value) for key, value in values.items()})
        else:
            self._extra.update(values)

    def record(self, row: dict[str, Any]) -> None:
        """Hold the row of the step just finished (written by :meth:`flush` at the next forward or step).

        Args:
            row: the step's metrics (step, times, bytes, consensus, ...); the running totals take its times and bytes.
        """
        self.flush()
        self._held = {**row, **{key: _plain(value) for key, value in self._extra.items()}}
        self._extra = {}
        self.last = self._held
        totals = self._totals
        totals.steps += 1
        for name in ("step_seconds", "compute_seconds", "finish_seconds", "bytes_sent", "bytes_received"):
            setattr(totals, name, getattr(totals, name) + row[name])
        if not math.isnan(row["wait_seconds"]):
            totals.wait_seconds += row["wait_seconds"]

    def flush(self) -> None:
        """Write the held row (to the JSON lines file, and to TensorBoard when available), if any."""
        if self._held is not None and self._file is not None:
            self._file.write(json.dumps(self._held) + "\n")
            self._file.flush()
        if self._held is not None and self._tensorboard is not None:
            step = self._held["step"]
            for name, value in self._held.items():
                if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(name, value, step)
        self._held = None

    def totals(self) -> dict[str, float]:
        """The running totals over the steps recorded so far.

        Returns:
            ``steps``, the summed ``*_seconds`` and ``bytes_sent`` / ``bytes_received``.
        """
        return dataclasses.asdict(self._totals)

    def summarize(self, comm: Communicator) -> dict[str, float] | None:
        """The summary over ranks. A collective: rank 0 gets it (and writes it to ``summary.json``); others get None.

        ``exposed_fraction`` is the share of the step's wall time spent blocked on communication, averaged over
        ranks; ``total_bytes_sent`` sums all ranks; times are per-step means averaged over ranks.

        Args:
            comm: the communicator of the run.

        Returns:
            The summary on rank 0, None on the other ranks.
        """
        gathered = comm.all_gather_object(self.totals())
        if comm.rank != 0:
            return None
        ranks = [t for t in gathered if t["steps"] > 0]
        if not ranks:
            return {"steps": 0}

        def mean(values: list[float]) -> float:
            return sum(values) / len(values)

        summary = {
            "ranks": len(gathered),
            "steps": ranks[0]["steps"],
            "mean_step_seconds": mean([t["step_seconds"] / t["steps"] for t in ranks]),
            "mean_compute_seconds": mean([t["compute_seconds"] / t["steps"] for t in ranks]),
            "mean_exposed_seconds": mean([t["wait_seconds"] / t["steps"] for t in ranks]),
            "exposed_fraction": mean([t["wait_seconds"] / max(t["step_seconds"], 1e-12) for t in ranks]),
            "total_bytes_sent": sum(t["bytes_sent"] for t in gathered),
            "total_bytes_received": sum(t["bytes_received"] for t in gathered),
        }
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self) -> None:
        """Write the held row and close the files."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
