"""The decoder layer loop's time per one-token pass with and without the drafter's hidden-state captures (stops):
times `fused_stack._call` on the first prompt of 6 Spec-Bench categories, 128 tokens, one thread, per config.

    python scripts/capture_cost.py plain '{"method": "eagle3"}' plain
"""
import collections, json, os, sys, time

import torch

import specloom.engine as E
from specloom.models import fused_stack as F
torch.set_num_threads(1)
rows=[json.loads(l) for l in open(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval", "spec_bench.jsonl"))]
first={}
for r in rows: first.setdefault(r["category"], r)
prompts=[r["turns"][0] for r in list(first.values())[:6]]
orig=F._call; rec=collections.defaultdict(list)
def timed(st, x, ctx, cos, sin, stops, n, ain=None):
    t=time.perf_counter(); r=orig(st, x, ctx, cos, sin, stops, n, ain); dt=time.perf_counter()-t
    if ain is None and x.shape[1]==1: rec[len([s for s in stops if 0<s<n])].append(dt)
    return r
F._call=timed
for cfg in sys.argv[1:]:
    rec.clear()
    eng=E.load("smollm2-135m", None if cfg=="plain" else cfg, speculation="auto", progress=False)
    for p in prompts: eng.generate(prompt=p, max_tokens=128, chat=True)
    for k,v in sorted(rec.items()):
        v=sorted(v); print(cfg, f"stops={k}: n={len(v)} median {1000*v[len(v)//2]:.3f} ms mean {1000*sum(v)/len(v):.3f} ms")
