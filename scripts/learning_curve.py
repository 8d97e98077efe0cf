"""Held-out acceptance against answer tokens trained on, from the `learning_curve` a training run records in its
checkpoint manifest (`specloom train ... --eval-every N`): one line per run and metric.

    python scripts/learning_curve.py RUN_DIR [RUN_DIR ...] --out docs/learning_curve.png [--metrics acc0,acc1]
        [--start DIR:LABEL]   # a run's step-0 figure from another run's manifest (e.g. the warm start's)
"""

import argparse
import json
import os


def curve(run: str) -> list[dict]:
    meta = json.load(open(os.path.join(run, "config.json")))
    meta = meta.get("specloom") or meta.get("specloom_dspark") or {}
    return (meta.get("manifest") or {}).get("learning_curve") or []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--metrics", default="acc0,acc1")
    ap.add_argument("--extra", action="append", default=[],
                    help='a point not in the manifest: "RUN:TOKENS:metric=value,metric=value" (e.g. step 0)')
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = args.metrics.split(",")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in args.runs:
        pts = [(e["answer_tokens_seen"], e) for e in curve(run)]
        for x in args.extra:
            r, tokens, vals = x.split(":", 2)
            if r == run:
                pts.append((float(tokens), {k: float(v) for k, v in (kv.split("=") for kv in vals.split(","))}))
        pts.sort(key=lambda p: p[0])
        for m in metrics:
            xs = [t / 1e6 for t, e in pts if m in e]
            ys = [e[m] for t, e in pts if m in e]
            ax.plot(xs, ys, marker="o", label=f"{os.path.basename(run.rstrip('/'))} {m}")
            print(run, m, [(round(x, 3), round(y, 3)) for x, y in zip(xs, ys)])
    ax.set_xlabel("answer tokens trained on (M)")
    ax.set_ylabel("held-out agreement with the target")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
