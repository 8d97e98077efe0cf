"""Where a step goes, plain decoding against EAGLE-3 as a depth-1 chain (`fixed`), in one process: medians per
call of the whole `Stepper.step`, the target pass, the drafter's `propose` and `on_verified`, verification,
KV begin / commit, emit, the policy's plan / observe; first prompt of 8 Spec-Bench categories, 128 tokens, 2
threads (BENCHMARKS.md, sixteenth session).

    python scripts/step_phases.py
"""
import collections
import statistics
import time

import torch

import specloom.engine as engine
import specbench_prompts
from specloom import depth, kv, step

torch.set_num_threads(2)
prompts = specbench_prompts.prompts(1)[:8]
T = collections.defaultdict(list)
cur = {"tag": "load"}


def wrap(obj, name, key):
    f = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T[(cur["tag"], key)].append(time.perf_counter() - t)
        return r

    setattr(obj, name, timed)


for obj, name in ((step.Stepper, "step"), (step.Stepper, "_target_pass"), (step, "verify"), (step.Row, "emit"),
                  (kv.KVCache, "commit"), (kv.KVCache, "begin"), (depth.DepthPolicy, "plan"),
                  (depth.DepthPolicy, "observe")):
    wrap(obj, name, name)
engines = {"plain": engine.load("smollm2-135m", None, progress=False),
           "eagle3 depth-1 chain": engine.load("smollm2-135m", '{"method": "eagle3", "num_speculative_tokens": 1, '
                                               '"tree_width": 1}', speculation="fixed", progress=False)}
d = engines["eagle3 depth-1 chain"].drafter
wrap(d, "propose", "propose")
wrap(d, "on_verified", "on_verified")
for tag, e in engines.items():
    cur["tag"] = tag
    e.generate(prompt=prompts[0], max_tokens=32, chat=True)  # warm-up
T.clear()
for p in prompts:
    for tag, e in engines.items():
        cur["tag"] = tag
        e.generate(prompt=p, max_tokens=128, chat=True)
for key in sorted({k for _, k in T}):
    cells = [f"{1000 * statistics.median(T[(tag, key)]):.3f} ms" if T.get((tag, key)) else "-" for tag in engines]
    print(f"{key:14s}" + "".join(f"  {tag}: {c}" for tag, c in zip(engines, cells)))
