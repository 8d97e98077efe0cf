"""Where `--speculation auto` spends a step against plain decoding: the engine's plan / step / observe timed per
step over the first prompt of 8 Spec-Bench categories (128 tokens, one thread), steps split into plain steps,
probes (an idle row's depth-1 check) and drafted steps; per kind the target pass and the drafting (catch-up
included) as the step reports them.

    python scripts/auto_steps.py plain '{"method": "eagle3"}' '{"method": "eagle3", "suffix_decoding": true}'
"""
import collections
import json
import os
import statistics
import sys
import time

import torch

import specloom.depth as depth
import specloom.engine as engine
from specloom import step as step_mod

torch.set_num_threads(1)
bench = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval", "spec_bench.jsonl")
first = {}
for r in map(json.loads, open(bench)):
    first.setdefault(r["category"], r)
prompts = [r["turns"][0] for r in list(first.values())[:8]]
T = collections.defaultdict(list)
plan0, step0, observe0 = depth.DepthPolicy.plan, step_mod.Stepper.step, depth.DepthPolicy.observe


def timed(fn, label):
    def run(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        T[label].append(time.perf_counter() - t)
        return out
    return run


def step(self, rows, plan):
    t = time.perf_counter()
    rep = step0(self, rows, plan)
    kind = "plain" if plan.depths[0] == 0 else ("probe" if getattr(plan, "probed", None) else "drafted")
    T["step " + kind].append(time.perf_counter() - t)
    T["  pass " + kind].append(rep.pass_seconds)
    T["  draft " + kind].append(rep.draft_seconds)
    return rep


depth.DepthPolicy.plan, depth.DepthPolicy.observe = timed(plan0, "plan"), timed(observe0, "observe")
step_mod.Stepper.step = step
for cfg in sys.argv[1:]:
    eng = engine.load("smollm2-135m", None if cfg == "plain" else cfg, speculation="auto", progress=False)
    for p in prompts[:2]:
        eng.generate(prompt=p, max_tokens=16, chat=True)
    T.clear()
    n, t0 = 0, time.perf_counter()
    for p in prompts:
        n += len(eng.generate(prompt=p, max_tokens=128, chat=True).token_ids)
    wall = time.perf_counter() - t0
    print(f"== {cfg}: {n / wall:.1f} tok/s over {wall:.2f} s (prefill included)")
    for k in sorted(T, key=lambda k: (k.strip().split()[-1], k)):
        v = T[k]
        print(f"  {k:16s} n={len(v):4d}  sum {sum(v) * 1e3:8.1f} ms  median {statistics.median(v) * 1e3:.3f} ms")
    del eng
