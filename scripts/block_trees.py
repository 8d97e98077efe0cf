"""Block drafters as chains and as trees at several node budgets: tau (tokens per target pass) on Spec-Bench
prompts (one per category by default), greedy, `--speculation fixed` (every step drafts its full depth), so the
figures are the drafters' own and not the host's. Acceptance only: no timing, safe on a busy host.

    python scripts/block_trees.py [--methods dflash,dspark] [--per-category 1] [--max-tokens 64] [--dtype bf16]
"""

import argparse
import json
from collections import defaultdict

from specloom import load

SHAPES = [("chain", {}), ("tree w3 n5", {"tree_width": 3, "num_draft_tokens": 5}),
          ("tree w3 n10", {"tree_width": 3, "num_draft_tokens": 10}),
          ("tree w4 n16", {"tree_width": 4, "num_draft_tokens": 16})]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="dflash,dspark")
    ap.add_argument("--model", default=None, help="a drafter directory for the (single) method")
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    seen, prompts = defaultdict(int), []
    for line in open(args.prompts):
        r = json.loads(line)
        if seen[r["category"]] < args.per_category:
            seen[r["category"]] += 1
            prompts.append(r["turns"][0])
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens each, greedy, {args.dtype}")
    print("| drafter | shape | nodes per step | tau | vs chain |")
    print("|---|---|---:|---:|---:|")
    for method in args.methods.split(","):
        chain_tau = None
        for name, extra in SHAPES:
            spec = {"method": method, **({"model": args.model} if args.model else {}), **extra}
            e = load("smollm2-135m", spec, dtype=args.dtype, progress=False, speculation="fixed")
            toks = passes = nodes = steps = 0
            for p in prompts:
                r = e.generate(messages=[{"role": "user", "content": p}], chat=True, max_tokens=args.max_tokens)
                toks += len(r.token_ids) - 1  # the prefill's token is not a step's
                passes += r.num_target_passes - 1
                nodes += r.num_draft_tokens
                steps += max(1, r.num_target_passes - 1)
            tau = toks / max(1, passes)
            chain_tau = chain_tau or tau
            print(f"| {method} | {name} | {nodes / steps:.1f} | {tau:.3f} | {tau / chain_tau:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
