"""Markdown tables for BENCHMARKS.md from a `bench --compare` report (and tree-tuning JSONs).

    python scripts/bench_tables.py out/bench_issue4.json [runs/tune_eagle3.json ...]
"""

import json
import sys


def main() -> None:
    rep = json.load(open(sys.argv[1]))
    c = rep["candidates"]
    print(f"{rep['num_prompts']} prompts, {rep['max_tokens']} tokens, {rep['dtype']}, greedy, batch 1, prefill "
          "included, each drafter interleaved with plain decoding (rotating order per prompt).\n")
    print("| drafter | settings | speed-up (median) | aggregate | tok/s (plain) | τ | acceptance per position α1…α4 | "
          "identical | max top-2 margin at a divergence |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in c.items():
        s = {k: v for k, v in r["speculative_config"].items() if k not in ("method", "model") and v is not False}
        a = " / ".join(f"{x:.2f}" for x in r["acceptance_per_position"][:4])
        m = r.get("max_top2_margin_at_divergence")
        print(f"| {name} | {json.dumps(s) if s else 'checkpoint defaults'} | {r['speedup']:.2f}× | "
              f"{r['speedup_aggregate']:.2f}× | {r['candidate_tokens_per_second']:.1f} ({r['baseline_tokens_per_second']:.1f}) | "
              f"{r['mean_accepted_length']:.2f} | {a} | {r['identical_outputs']}/{r['num_prompts']} | "
              f"{'-' if m is None else f'{m:.2f}'} |")
    if all("draft_ms_per_step" in r for r in c.values()):
        print("\nCosts: drafting time per verification step (its share of one plain decode step, same run) and the "
              "drafter's memory (own weights as loaded, KV cache per 1000 tokens of context).\n")
        print("| drafter | τ | acceptance per position α1…α5 | drafting ms/step (× target step) | speed-up (median / "
              "aggregate) | weights MB | KV MB per 1k tokens |")
        print("|---|---|---|---|---|---|---|")
        for name, r in c.items():
            a = " / ".join(f"{x:.2f}" for x in r["acceptance_per_position"][:5])
            mem = r.get("drafter_memory_bytes", {})
            print(f"| {name} | {r['mean_accepted_length']:.2f} | {a} | {r['draft_ms_per_step']:.1f} "
                  f"({r['draft_fraction_of_target_step']:.2f}) | {r['speedup']:.2f}× / {r['speedup_aggregate']:.2f}× | "
                  f"{mem.get('weights', 0) / 1e6:.1f} | {mem.get('kv_per_1k_tokens', 0) / 1e6:.2f} |")
    cats = sorted({k for r in c.values() for k in r["per_category"]})
    print("\nPer category: speed-up (τ)\n")
    print("| category | " + " | ".join(c) + " |")
    print("|---|" + "---|" * len(c))
    for cat in cats:
        cells = []
        for r in c.values():
            s = r["per_category"].get(cat)
            cells.append(f"{s['speedup']:.2f}× ({s['mean_accepted_length']:.2f})" if s else "-")
        print(f"| {cat} | " + " | ".join(cells) + " |")
    for path in sys.argv[2:]:
        t = json.load(open(path))
        print(f"\nTree tuning ({path}): verify cost v(n) = " + ", ".join(f"v({k})={v:.2f}" for k, v in t["verify_cost"].items()))
        print("\n| depth | width | nodes | τ | drafting (target steps) | v(nodes+1) | predicted τ/(v+c) | measured |")
        print("|---|---|---|---|---|---|---|---|")
        for r in t["rows"]:
            star = " **chosen**" if r == t["chosen"] else ""
            print(f"| {r['depth']} | {r['tree_width']} | {r['num_draft_tokens']} | {r['tau']:.2f} | {r['draft_cost']:.2f} | "
                  f"{r['verify_cost']:.2f} | {r['predicted_speedup']:.2f}×{star} | {r['measured_speedup']:.2f}× |")


if __name__ == "__main__":
    main()
