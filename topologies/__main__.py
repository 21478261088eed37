"""``python -m topologies describe NAME -n N [--plot FILE.png]`` and ``python -m topologies compare -n N``."""

from __future__ import annotations

import argparse
import sys

from topologies import analysis
from topologies.registry import by_name, names
from topologies.report import CONSENSUS_TOL, ScheduleSummary, compare, summarize
from topologies.schedule import ScheduleError


def _fmt_steps(steps: int | None) -> str:
    return "not reached" if steps is None else str(steps)


def _describe(args: argparse.Namespace) -> None:
    options = {"per_node": args.per_node, "seed": args.seed, "degree": args.degree, "p": args.p}
    options.update({"rows": args.rows, "weights": args.weights})
    schedule = by_name(args.name, args.n, **options)
    s = summarize(schedule, args.tol)
    print(f"schedule            {schedule!r}")
    print(f"period              {s.period_label}")
    print(f"in-degree           {s.min_in_degree}..{s.max_in_degree}")
    print(f"symmetric           {s.symmetric}")
    print(f"doubly stochastic   {s.doubly_stochastic}")
    print(f"rho per step        {', '.join(f'{r:.4f}' for r in s.step_rhos)} (||W - J||_2)")
    print(f"gap per step        {', '.join(f'{g:.4f}' for g in s.step_gaps)} (1 - |lambda_2(W)|)")
    print(f"rho per period      {s.period_rho:.4g}")
    rate = analysis.expected_consensus_rate(schedule)
    print(f"consensus rate      p = {rate.p:.4g} over tau = {rate.tau} step(s)")
    if schedule.period == 1 and s.symmetric:
        print(f"optimal gamma*      {analysis.optimal_overrelaxation(schedule):.4f}")
    print(f"steps to consensus  {_fmt_steps(s.steps_to_consensus)} (Xi_t^2 <= {args.tol:g} Xi_0^2, worst case)")
    print(f"noise floor         {s.noise_floor:.4g} (steady Xi^2 per coordinate, unit noise per rank and step)")
    groups = schedule.groups(0)
    if groups is not None:
        print(f"groups at t=0       {groups}")
    if args.plot:
        from topologies.plot import draw_schedule

        drawn = draw_schedule(schedule, args.plot)
        print(f"plot                {args.plot} (steps {drawn[0]}..{drawn[-1]})")


def _table(rows: list[ScheduleSummary]) -> str:
    header = ("schedule", "period", "in-deg", "sym", "d.s.", "max rho/step", "min gap/step", "rho/period", "steps",
              "floor")  # fmt: skip
    lines = [header]
    for s in rows:
        lines.append(
            (
                s.name,
                str(s.period) if s.period is not None else f"- ({s.steps_checked})",
                f"{s.min_in_degree}-{s.max_in_degree}" if s.min_in_degree != s.max_in_degree else str(s.max_in_degree),
                "yes" if s.symmetric else "no",
                "yes" if s.doubly_stochastic else "no",
                f"{max(s.step_rhos):.4f}",
                f"{min(s.step_gaps):.4f}",
                f"{s.period_rho:.4f}",
                _fmt_steps(s.steps_to_consensus),
                f"{s.noise_floor:.3f}",
            )
        )
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def _compare(args: argparse.Namespace) -> None:
    built, skipped = compare(args.n, args.tol)
    print(f"built-in schedules at n={args.n} (rho = ||W - J||_2 and gap = 1 - |lambda_2(W)| per step;")
    print("rho/period for the product over one period, or over the first steps checked when aperiodic;")
    print(f"steps = worst case steps to Xi_t^2 <= {args.tol:g} * Xi_0^2; floor = the steady Xi^2 per coordinate")
    print("when every rank adds unit noise each step, as gradient steps do: lower keeps replicas closer)")
    print(_table(built))
    for name, reason in skipped:
        print(f"skipped {name}: {reason}")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m topologies``: the ``describe`` and ``compare`` sub-commands and their options.

    Returns:
        A parser whose parsed namespace carries ``run``, the function that executes the chosen sub-command.
    """
    parser = argparse.ArgumentParser(prog="python -m topologies", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    describe = sub.add_parser("describe", help="period, degrees, rho and consensus speed of one schedule")
    describe.add_argument("name", choices=names())
    describe.add_argument("-n", type=int, required=True, help="number of ranks")
    describe.add_argument("--per-node", type=int, help="ranks per node (hierarchical, alternating_exp_ring)")
    describe.add_argument("--seed", type=int, help="seed (random_regular, erdos_renyi, random_matchings)")
    describe.add_argument("--degree", type=int, help="degree (random_regular)")
    describe.add_argument("-p", type=float, help="edge probability (erdos_renyi)")
    describe.add_argument("--rows", type=int, help="rows (torus)")
    describe.add_argument("--weights", choices=("uniform", "metropolis"), help="edge weighting (static graphs)")
    describe.add_argument("--plot", metavar="FILE.png", help="draw the step graphs of one period")
    describe.add_argument("--tol", type=float, default=CONSENSUS_TOL, help="consensus tolerance")
    describe.set_defaults(run=_describe)
    comp = sub.add_parser("compare", help="tabulate every built-in schedule at n ranks")
    comp.add_argument("-n", type=int, required=True, help="number of ranks")
    comp.add_argument("--tol", type=float, default=CONSENSUS_TOL, help="consensus tolerance")
    comp.set_defaults(run=_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m topologies`` on ``argv`` and print the result to stdout.

    A schedule that cannot be built (for example ``one_peer_hypercube`` at n = 6) is reported on stderr as
    ``error: ...`` with exit status 2 instead of a traceback.

    Args:
        argv: the command-line arguments without the program name; None reads ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 when the schedule is invalid.

    Raises:
        SystemExit: from argparse, on unknown or missing arguments (status 2) and for ``--help`` (status 0).
    """
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except ScheduleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
