"""Medians over several `specloom bench-serve --json` runs: per concurrency level and mode, tokens/s and the ratio
to "off" of the same run, as a Markdown table (plus each run's ratios), and a plot of the median ratios.

    python scripts/serve_medians.py out/serve_eagle3_run*.json --plot docs/serve_eagle3_batched.png
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--plot")
    a = ap.parse_args()
    runs = [json.load(open(p)) for p in a.runs]
    levels = sorted({int(c) for r in runs for c in r["levels"]})
    modes = ("off", "fixed", "load_aware")
    med = {}
    print("| concurrency | off tok/s | fixed tok/s (x off) | load-aware tok/s (x off) | load-aware mean depth | "
          "fixed x off per run | load-aware x off per run |")
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        got = [r["levels"][str(c)] for r in runs if str(c) in r["levels"]]
        tps = {m: statistics.median(g[m]["tokens_per_second"] for g in got) for m in modes}
        ratio = {m: [g[m]["tokens_per_second"] / g["off"]["tokens_per_second"] for g in got] for m in modes}
        med[c] = {m: statistics.median(ratio[m]) for m in modes}
        depth = statistics.median(g["load_aware"]["mean_depth"] for g in got)
        print(f"| {c} | {tps['off']:.1f} | {tps['fixed']:.1f} ({med[c]['fixed']:.2f}x) | {tps['load_aware']:.1f} "
              f"({med[c]['load_aware']:.2f}x) | {depth:.2f} | {' / '.join(f'{x:.2f}' for x in ratio['fixed'])} | "
              f"{' / '.join(f'{x:.2f}' for x in ratio['load_aware'])} |")
    c1, c4 = med.get(1), med.get(4)
    if c1 and c4:
        print(f"\nfixed/off at c=4 relative to c=1: {c4['fixed'] / c1['fixed']:.2f}; load-aware min: "
              f"{min(m['load_aware'] for m in med.values()):.2f}x off")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for m, style in (("fixed", "o-"), ("load_aware", "s-")):
            ax.plot(levels, [med[c][m] for c in levels], style, label=m)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("throughput x off (median of runs)")
        ax.set_title(f"{runs[0]['model']}: {runs[0]['speculative_config']} ({len(runs)} runs)", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=90)


if __name__ == "__main__":
    main()
