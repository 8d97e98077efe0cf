"""The target's real pass times per width inside generation, against the cached verify-cost curve: every
single-row pass of `Stepper._target_pass` of up to 16 tokens, timed, over the first prompt of 8 Spec-Bench
categories (128 tokens, `fixed`, 2 threads), for each configuration given; medians in decode steps (width 1).

    python scripts/live_pass_widths.py plain '{"method": "eagle3"}' '{"method": "ngram", "num_speculative_tokens": 8}'
"""
import json
import os
import statistics
import sys
import time

import torch

import specloom.engine as engine
from specloom import step as step_mod
from specloom.cost import batch_cost_cached

torch.set_num_threads(2)
bench = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval", "spec_bench.jsonl")
first: dict = {}
for r in map(json.loads, open(bench)):
    first.setdefault(r["category"], r)
prompts = [r["turns"][0] for r in list(first.values())[:8]]
widths: dict = {}
pass0 = step_mod.Stepper._target_pass


def timed(self, tokens, positions, p, mask, capture):
    t = time.perf_counter()
    out = pass0(self, tokens, positions, p, mask, capture)
    if tokens.shape[0] == 1 and tokens.shape[1] <= 16:
        widths.setdefault(tokens.shape[1], []).append(time.perf_counter() - t)
    return out


step_mod.Stepper._target_pass = timed
engines = [engine.load("smollm2-135m", None if c == "plain" else c, speculation="fixed", progress=False)
           for c in sys.argv[1:]]
curve = batch_cost_cached(engines[0].model, 1)
for e in engines:
    e.generate(prompt=prompts[0], max_tokens=32, chat=True)  # warm-up
widths.clear()
for p in prompts:
    for e in engines:
        e.generate(prompt=p, max_tokens=128, chat=True)
one = statistics.median(widths[1])
print("| width | passes | median ms | decode steps | the cached curve |")
print("|---:|---:|---:|---:|---:|")
for w in sorted(widths):
    m = statistics.median(widths[w])
    print(f"| {w} | {len(widths[w])} | {1000 * m:.3f} | {m / one:.3f} | {curve(1, w):.3f} |")
