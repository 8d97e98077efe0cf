"""What more data buys: every bundled version of each drafter kind, scored on the same held-out batches, against
the answer tokens it had been trained on in all (log scale), with a least-squares line per kind.

    python scripts/data_scaling.py POINTS.json --out docs/data_scaling.png [--target-acc0 0.75] [--target-tau 2.5]

POINTS.json: {"kind": [{"label": ..., "tokens": cumulative answer tokens trained on, "evals": path of the
evals.json the trainer wrote when scoring that checkpoint (`specloom train KIND --init-from CKPT --steps 1 --lr 0`,
the dataset's held-out split, 8 batches) or "eval": that file's last entry inline, "fit": false for a version
trained on another data mix (drawn hollow, left out of the fit: its step to the next version mixes more data with a change of domain)}, ...], ...}.

Two panels: held-out acc0 (top-1 agreement at the first draft position), and the held-out chain τ
1 + a0 + a0*a1 + ... from the per-position agreements (for the block drafters this is the trainer's own greedy-chain
τ given the anchor, to within a percent). Prints per kind the slope per doubling of the tokens and, at that slope,
the tokens at which each target would be reached. A fit over 2-4 versions trained with different schedules is a
rough guide, not a law: say so wherever its figures are quoted.
"""

from __future__ import annotations

import argparse
import json
import math


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + b * log2(x), least squares (two or more points)."""
    lx = [math.log2(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    sxx = sum((v - mx) ** 2 for v in lx)
    b = sum((v - mx) * (y - my) for v, y in zip(lx, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def chain_tau(ev: dict) -> float:
    """1 + a0 + a0 a1 + ... over the evaluation's per-position agreements acc0, acc1, ..."""
    tau, p = 1.0, 1.0
    for k in sorted((k for k in ev if k.startswith("acc") and k[3:].isdigit()), key=lambda k: int(k[3:])):
        p *= ev[k]
        tau += p
    return tau


METRICS = {"acc0": lambda ev: ev["acc0"], "chain tau": chain_tau}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("points")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target-acc0", type=float, default=0.75)
    ap.add_argument("--target-tau", type=float, default=2.5)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = {k: v for k, v in json.load(open(a.points)).items() if not k.startswith("_")}  # "_note": provenance
    targets = {"acc0": a.target_acc0, "chain tau": a.target_tau}
    top = max(p["tokens"] for v in kinds.values() for p in v) * 8 / 1e6
    ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50, 100) if t <= top]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    print("kind\tversion\ttokens\t" + "\t".join(METRICS))
    for n, (kind, pts) in enumerate(kinds.items()):
        evs = [p["eval"] if "eval" in p else json.load(open(p["evals"]))[-1] for p in pts]
        for p, ev in zip(pts, evs):
            print(f"{kind}\t{p['label']}\t{p['tokens'] / 1e6:.2f}M\t"
                  + "\t".join(f"{f(ev):.3f}" for f in METRICS.values())
                  + ("" if p.get("fit", True) else "\t(another data mix: not fitted)"))
        for ax, (name, f) in zip(axes, METRICS.items()):
            ys = [f(ev) for ev in evs]
            ax.plot([p["tokens"] / 1e6 for p in pts], ys, "-", color=f"C{n}", label=kind)
            for p, y in zip(pts, ys):
                ax.plot([p["tokens"] / 1e6], [y], "o", color=f"C{n}",
                        markerfacecolor=f"C{n}" if p.get("fit", True) else "none")
            fx = [(p["tokens"], y) for p, y in zip(pts, ys) if p.get("fit", True)]
            if len(fx) < 2:
                continue
            c, b = fit([x for x, _ in fx], [y for _, y in fx])
            lo, hi = min(x for x, _ in fx), max(x for x, _ in fx) * 8
            grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
            ax.plot([g / 1e6 for g in grid], [c + b * math.log2(g) for g in grid], ":", color=f"C{n}", alpha=0.6)
            t = targets[name]
            positions = sum(k.startswith("acc") and k[3:].isdigit() for k in evs[-1])
            need = (f"{t} out of reach: {positions} scored position(s) cap it at {1 + positions}"
                    if name == "chain tau" and 1 + positions <= t else
                    f"{t} at ~{2 ** ((t - c) / b) / 1e6:.0f}M tokens" if b > 0 else "no rise")
            print(f"{kind}\tfit over {len(fx)} versions: {name} {b:+.3f} per doubling; {need}")
    for ax, name in zip(axes, METRICS):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.axhline(targets[name], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("answer tokens trained on, all versions together (M, log scale)")
        ax.set_ylabel(f"held-out {name} (same 8 batches)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("Bundled SmolLM2-135M drafters, every version, on one held-out split: what more data bought\n"
                 "(hollow: trained on another data mix, not fitted; dotted: log-linear fit, extended to 8x the data)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
