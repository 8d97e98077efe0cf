"""What each kind of step under `--speculation auto` really bought: per step kind (plain, a drafted depth, a probe,
a step with a drafter catch-up, a free draft), the tokens a step emitted against what the policy expected, and
its whole wall time (the policy's `plan` to its `observe`: drafting, the pass, verification, commit) in plain
steps of the same run -- so a kind's realized speed-up is tokens per step / (its step time / a plain step's).
26 Spec-Bench prompts (2 per category), 128 tokens, chat, 2 threads; run it on a quiet host.

    python scripts/realized_steps.py '{"method": "eagle3", "suffix_decoding": true}'
"""
import statistics
import sys
import time

import torch

import specloom.engine as engine
import specbench_prompts
from specloom import depth

torch.set_num_threads(2)
prompts = specbench_prompts.prompts(2)
eng = engine.load("smollm2-135m", sys.argv[1], speculation="auto", progress=False)
records, clock = [], {}
plan0, observe0 = depth.DepthPolicy.plan, depth.DepthPolicy.observe


def plan(self, stepper, rows, caps=None):
    clock["t"] = time.perf_counter()
    return plan0(self, stepper, rows, caps)


def observe(self, rows, plan, rep):
    took, k = time.perf_counter() - clock["t"], plan.depths[0]
    kind = ("plain" if k == 0 else "probe" if plan.probed else "free draft" if plan.free
            else "catch-up" if plan.backlog else f"depth {k}")
    records.append((kind, 1 + rep.accepted[0], took, depth.geometric_tokens(plan.alphas[0], k) if k else 1.0))
    return observe0(self, rows, plan, rep)


depth.DepthPolicy.plan, depth.DepthPolicy.observe = plan, observe
for p in prompts[:2]:  # warm-up
    eng.generate(prompt=p, max_tokens=32, chat=True)
records.clear()
for p in prompts:
    eng.generate(prompt=p, max_tokens=128, chat=True)
plain = statistics.median(t for kind, _, t, _ in records if kind == "plain")
print(f"{sys.argv[1]}: {len(records)} steps, a plain step {1000 * plain:.2f} ms (median)")
print("| step kind | steps | tokens / step (expected) | step time (plain steps) | realized speed-up |")
print("|---|---:|---:|---:|---:|")
for kind in sorted({r[0] for r in records}):
    rs = [r for r in records if r[0] == kind]
    tok, t = sum(r[1] for r in rs) / len(rs), statistics.median(r[2] for r in rs) / plain
    print(f"| {kind} | {len(rs)} | {tok:.2f} ({sum(r[3] for r in rs) / len(rs):.2f}) | {t:.2f} | {tok / t:.2f}x |")
