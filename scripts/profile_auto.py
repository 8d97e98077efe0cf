"""Where `--speculation auto` spends its time against plain decoding: cProfile over the first prompt of 8 Spec-Bench
categories (128 tokens, one thread), the engine's step functions by cumulative time.

    python scripts/profile_auto.py plain
    python scripts/profile_auto.py '{"method": "eagle3"}'
"""
import cProfile, json, os, pstats, sys, time

import torch

import specloom.engine as E
torch.set_num_threads(1)
rows=[json.loads(l) for l in open(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval", "spec_bench.jsonl"))]
first={}
for r in rows: first.setdefault(r["category"], r)
prompts=[r["turns"][0] for r in list(first.values())[:8]]
cfg=sys.argv[1]
eng=E.load("smollm2-135m", None if cfg=="plain" else cfg, speculation="auto", progress=False)
for p in prompts[:2]: eng.generate(prompt=p, max_tokens=16, chat=True)
pr=cProfile.Profile(); n=steps=0
t0=time.perf_counter(); pr.enable()
for p in prompts:
    r=eng.generate(prompt=p, max_tokens=128, chat=True); n+=len(r.token_ids); steps+=r.num_target_passes
pr.disable(); wall=time.perf_counter()-t0
print(cfg, f"tok/s {n/wall:.1f} tau {n/steps:.3f} passes {steps}")
st=pstats.Stats(pr); st.sort_stats("cumtime").print_stats(r"step\.py|drafter|depth|policy|verify|engine", 22)
