"""`specloom report`: the peer report from bench runs."""

from __future__ import annotations


def add(sub) -> None:
    p = sub.add_parser("report", help="the peer report: one table per target (specloom plain, specloom + drafter, "
                        "every peer) and a bar chart, from `specloom bench --baseline plain,... --json` runs")
    p.add_argument("out", help="Markdown file to write (the chart goes beside it as .png)")
    p.add_argument("--bench", nargs="+", required=True, metavar="JSON", help="bench reports, one per target")
    p.add_argument("--png", default=None, help="where the bar chart goes (default: OUT with .png)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..bench.peer_report import write_report

    png = write_report(args.out, args.bench, args.png)
    print(f"{args.out}\n{png}")
    return 0
