"""Where a speculative step's time goes, per configuration, in one process: tokens/s, ms per target pass, the
drafter's share (GenerationResult.draft_seconds) and the target's layer stack (timed around fused_stack's call),
on the first prompt of each of 8 Spec-Bench categories, 128 tokens, fixed depth, the second of two rounds
(BENCHMARKS.md, the host without AMX). Run from two checkouts (PYTHONPATH=<checkout>) to compare them.

    python scripts/step_split.py plain '{"method": "eagle3", "suffix_decoding": true}' '{"method": "ngram"}'
"""

import json
import sys
import time

import torch

import specloom.engine as E
from specloom.models import fused_stack


def main() -> None:
    torch.set_num_threads(2)
    rows = [json.loads(line) for line in open("../shared/data/eval/spec_bench.jsonl")]
    first: dict = {}
    for r in rows:
        first.setdefault(r["category"], r)
    prompts = [r["turns"][0] for r in list(first.values())[:8]]
    stack = [0.0]
    call = fused_stack._call

    def timed(st, x, ctx, cos, sin, stops, n_layers, ain=None):
        t = time.perf_counter()
        out = call(st, x, ctx, cos, sin, stops, n_layers, ain)
        if ain is None and x.shape[1] < 20:  # the target's decode and verification passes, not prefill or drafter
            stack[0] += time.perf_counter() - t
        return out

    fused_stack._call = timed
    for cfg in sys.argv[1:]:
        eng = E.load("smollm2-135m", None if cfg == "plain" else cfg, speculation="fixed", progress=False)
        for _ in range(2):
            stack[0] = tot = drafted = 0.0
            n = steps = 0
            for p in prompts:
                r = eng.generate(p, chat=True, max_tokens=128)
                tot += r.total_seconds - r.prefill_seconds
                drafted += r.draft_seconds
                n += len(r.token_ids)
                steps += r.num_target_passes
        print(f"{cfg[:40]:40s} {n / tot:6.1f} tok/s  {1000 * tot / steps:5.2f} ms/step  draft "
              f"{1000 * drafted / steps:4.2f}  target-stack {1000 * stack[0] / steps:4.2f}  tau {n / steps:.2f}")


if __name__ == "__main__":
    main()
