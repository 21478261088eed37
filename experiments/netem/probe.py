"""Probe an emulated network with Gloo and MPI: half round trip, bandwidth, and a 4-rank 100 MB all-reduce.

``python -m experiments.netem probe --rate 1gbit --delay-ms 1`` builds a network of ``--hosts`` hosts, runs
probe_worker.py once per backend on it, and prints one line per backend with the settings and the numbers.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from experiments.netem.launch import run_gloo, run_mpi
from experiments.netem.network import EmulatedNetwork
from experiments.netem.probe_worker import RESULT_MARKER


def run_probe(
    hosts: int = 4,
    rate: str | None = None,
    delay_ms: float = 0.0,
    backends: Sequence[str] = ("gloo", "mpi"),
    bandwidth_mb: float = 64.0,
    allreduce_mb: float = 100.0,
    repeats: int = 2,
    timeout_s: float = 600.0,
) -> dict[str, dict[str, float]]:
    """Measure each backend on a fresh network; return ``{backend: {metric: value}}``."""
    results: dict[str, dict[str, float]] = {}
    for backend in backends:
        lines: list[str] = []

        def keep(line: str, lines: list[str] = lines) -> None:
            lines.append(line)
            if RESULT_MARKER not in line:
                sys.stderr.write(line)

        argv = [
            sys.executable, "-m", "experiments.netem.probe_worker", "--backend", backend,
            "--bandwidth-mb", str(bandwidth_mb), "--allreduce-mb", str(allreduce_mb),
            "--repeats", str(repeats), "--timeout", str(timeout_s),
        ]  # fmt: skip
        with EmulatedNetwork(hosts=hosts, rate=rate, delay_ms=delay_ms) as net:
            if backend == "gloo":
                code = run_gloo(net, argv, timeout_s=timeout_s, sink=keep)
            else:
                code = run_mpi(net, argv, timeout_s=timeout_s, sink=keep)
        found = [line.split(RESULT_MARKER, 1)[1] for line in lines if RESULT_MARKER in line]
        if code != 0 or not found:
            raise RuntimeError(f"probe with backend={backend} failed (exit code {code}); output above")
        results[backend] = json.JSONDecoder().raw_decode(found[-1].strip())[0]
    return results


def format_results(settings: str, results: dict[str, dict[str, float]], allreduce_mb: float, hosts: int) -> str:
    """One line per backend: the settings and the measured numbers."""
    rows = []
    for backend, values in results.items():
        rows.append(
            f"{settings:<32} {backend:<5} half RTT {values['half_rtt_ms']:8.3f} ms   "
            f"bandwidth {values['bandwidth_gbit_s']:7.3f} Gbit/s   "
            f"{hosts}-rank all_reduce {allreduce_mb:g} MB {values['allreduce_s']:7.3f} s"
        )
    return "\n".join(rows)
