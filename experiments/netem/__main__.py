"""Command line: ``python -m experiments.netem {run,probe,cleanup}`` (needs root; see README.md).

run      --hosts 8 --rate 1gbit [--delay-ms 1] [--backend gloo|mpi] [--timeout S] -- python train.py ...
probe    --rate 1gbit --delay-ms 1 [--hosts 4] [--backends gloo,mpi]
cleanup  [--all]   remove namespaces and forwarders of dead owners (with --all: of every owner)
"""

from __future__ import annotations

import argparse
import sys

from experiments.netem.cleanup import cleanup_stale
from experiments.netem.launch import run_gloo, run_mpi
from experiments.netem.network import EmulatedNetwork
from experiments.netem.probe import format_results, run_probe


def _add_network_arguments(parser: argparse.ArgumentParser, hosts: int) -> None:
    parser.add_argument("--hosts", type=int, default=hosts, help="number of emulated hosts (= ranks)")
    parser.add_argument("--rate", default=None, help="per-host limit, e.g. 1gbit, 100mbit")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (> 0: TUN forwarder)")
    parser.add_argument("--mtu", type=int, default=None, help="device MTU (default 1500 veth, 65000 TUN)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.netem", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one process per host (after --)")
    _add_network_arguments(run, hosts=2)
    run.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument("--timeout", type=float, default=None, help="kill all ranks after this many seconds")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- command to run on every host")
    probe = commands.add_parser("probe", help="measure latency, bandwidth and all-reduce time")
    _add_network_arguments(probe, hosts=4)
    probe.add_argument("--backends", default="gloo,mpi")
    probe.add_argument("--bandwidth-mb", type=float, default=64.0)
    probe.add_argument("--allreduce-mb", type=float, default=100.0)
    probe.add_argument("--repeats", type=int, default=2)
    cleanup = commands.add_parser("cleanup", help="remove leftovers of dead owners")
    cleanup.add_argument("--all", action="store_true", help="also of owners that are still alive")
    args = parser.parse_args(argv)

    if args.command == "cleanup":
        removed = cleanup_stale(include_alive=args.all)
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    if args.command == "probe":
        results = run_probe(
            hosts=args.hosts,
            rate=args.rate,
            delay_ms=args.delay_ms,
            backends=args.backends.split(","),
            bandwidth_mb=args.bandwidth_mb,
            allreduce_mb=args.allreduce_mb,
            repeats=args.repeats,
        )
        settings = f"rate={args.rate or 'none'} delay={args.delay_ms:g}ms"
        print(format_results(settings, results, args.allreduce_mb, args.hosts))
        return 0
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("run: give the command after --, e.g. -- python train.py")
    with EmulatedNetwork(hosts=args.hosts, rate=args.rate, delay_ms=args.delay_ms, mtu=args.mtu) as net:
        if args.backend == "gloo":
            return run_gloo(net, command, master_port=args.master_port, timeout_s=args.timeout)
        return run_mpi(net, command, timeout_s=args.timeout)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the network is already torn down by then
        sys.exit(130)
