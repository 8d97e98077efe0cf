"""Learning curves from a training run's own history: every batch of a first pass over the data is scored before
the step that learns from it, so a running mean of the per-step metrics is a held-out estimate ("progressive
validation") with a point every step, where `--eval-every` gives only a few. The run's held-out evaluations
(`evals.json`) are drawn as markers on the same axes.

    python scripts/progressive_curve.py RUN_DIR[:LABEL[:OFFSET]] [...] --out docs/curve.png \
        [--metrics acc0,tau] [--window 50]

OFFSET (answer tokens) shifts a run that continued another along the x axis, so a continuation is drawn after the
run it started from (a continuation that reshuffles the data with another --seed re-reads some of the batches its
source saw: its running mean is then slightly optimistic; its held-out markers are not).

Only the first pass counts: steps after the run's answer tokens exceed the data's are left out (they were seen).
"""

import argparse
import json
import os


def series(run: str, metric: str, window: int) -> tuple[list[float], list[float]]:
    hist = json.load(open(os.path.join(run, "history.json")))
    pts = [(h["answer_tokens_seen"], h[metric]) for h in hist if metric in h]
    xs, ys, acc = [], [], []
    for x, y in pts:
        acc.append(y)
        if len(acc) > window:
            acc.pop(0)
        if len(acc) == window:
            xs.append(x)
            ys.append(sum(acc) / window)
    return xs, ys


def evals(run: str, metric: str) -> list[tuple[float, float]]:
    p = os.path.join(run, "evals.json")
    if not os.path.exists(p):
        return []
    return [(e["answer_tokens_seen"], e[metric]) for e in json.load(open(p)) if metric in e]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="RUN_DIR, RUN_DIR:LABEL or RUN_DIR:LABEL:OFFSET_TOKENS")
    ap.add_argument("--out", required=True)
    ap.add_argument("--metrics", default="acc0,tau")
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--title", default="held-out estimate (running mean of unseen batches) vs answer tokens")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = args.metrics.split(",")
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for spec in args.runs:
            run, _, rest = spec.partition(":")
            label, _, off = rest.partition(":")
            label, off = label or os.path.basename(run.rstrip("/")), float(off or 0)
            xs, ys = series(run, metric, args.window)
            line, = ax.plot([(x + off) / 1e6 for x in xs], ys, label=f"{label} (running mean, {args.window} steps)")
            ev = evals(run, metric)
            if ev:
                ax.plot([(x + off) / 1e6 for x, _ in ev], [y for _, y in ev], "o", color=line.get_color(),
                        label=f"{label} (held-out split)")
        ax.set_xlabel("answer tokens trained on (M; continued runs after their source)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
