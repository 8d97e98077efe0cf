"""EAGLE-3's `propose` as a depth-1 chain (`fixed`) with the one-call pass (kernels/decoder_stack.c
`eagle3_pass`) and without it, alternating per prompt in one process: medians per call over the first prompt of 8
Spec-Bench categories, 128 tokens, 2 rounds, 2 threads; and how many calls took the one-call path.

    python scripts/one_call_propose.py
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specloom.engine as engine
from specloom.models import fused_stack
import specbench_prompts
torch.set_num_threads(2)
prompts = specbench_prompts.prompts(1)[:8]
eng = engine.load("smollm2-135m", '{"method": "eagle3", "num_speculative_tokens": 1, "tree_width": 1}', speculation="fixed", progress=False)
d = eng.drafter
used = [0, 0]
r0 = fused_stack.run_eagle3
def r(*a, **k):
    out = r0(*a, **k); used[out is None] += 1; return out
fused_stack.run_eagle3 = r
T = {"c": [], "py": []}
p0 = d.propose
mode = ["c"]
def timed(ctxs):
    t = time.perf_counter(); out = p0(ctxs); T[mode[0]].append(time.perf_counter() - t); return out
d.propose = timed
eng.generate(prompt=prompts[0], max_tokens=64, chat=True)
for rnd in range(2):
    for p in prompts:
        for m in ("c", "py"):
            mode[0] = m
            if m == "py": d.model.eagle_step = lambda: None
            else: d.model.__dict__.pop("eagle_step", None)
            eng.generate(prompt=p, max_tokens=128, chat=True)
print("C used / fallback", used)
for k, v in T.items(): print(k, len(v), f"median {1000*statistics.median(v):.3f} ms")
