"""`specloom plot`: acceptance per position from bench reports."""

from __future__ import annotations


def add(sub) -> None:
    p = sub.add_parser("plot", help="draw acceptance per position from bench reports (needs matplotlib)")
    p.add_argument("reports", nargs="+", help="JSON reports written by `specloom bench --json`")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..bench.plots import plot_acceptance

    plot_acceptance(args.reports, args.out)
    print(args.out)
    return 0
