"""Depth-policy variants of one drafter against plain decoding, interleaved prompt by prompt in one process (the
order alternating), so that host drift hits all alike: tokens/s without prefill, the ratio to plain decoding and
tau. Each variant sets attributes of its engine's `DepthPolicy`. 26 Spec-Bench prompts (2 per category), 128
tokens, chat, `auto`, 2 threads, `ROUNDS` rounds (default 2). Two copies of the same variant read within ~1.5 %.

    python scripts/ab_policy.py '{"method": "eagle3"}' base: 'no-probes:explore_base=1e9,explore_max=1e9'
"""
import os
import sys

import torch

import specloom.engine as engine
import specbench_prompts

torch.set_num_threads(2)
prompts = specbench_prompts.prompts(2)
engines = [("plain", engine.load("smollm2-135m", None, progress=False))]
for spec in sys.argv[2:]:
    name, _, attrs = spec.partition(":")
    eng = engine.load("smollm2-135m", sys.argv[1], speculation="auto", progress=False)
    policy = eng.depth_policy()
    for kv in filter(None, attrs.split(",")):
        key, value = kv.split("=")
        setattr(policy, key, type(getattr(policy, key))(float(value)))
    engines.append((name, eng))
for _, e in engines:
    e.generate(prompt=prompts[0], max_tokens=32, chat=True)  # warm-up
stats = {name: [0.0, 0, 0] for name, _ in engines}  # decode seconds, tokens, target passes
for rnd in range(int(os.environ.get("ROUNDS", "2"))):
    for i, p in enumerate(prompts):
        for name, e in (engines if (i + rnd) % 2 == 0 else engines[::-1]):
            r = e.generate(prompt=p, max_tokens=128, chat=True)
            s = stats[name]
            s[0] += r.total_seconds - r.prefill_seconds
            s[1] += len(r.token_ids)
            s[2] += r.num_target_passes
base = stats["plain"][1] / stats["plain"][0]
for name, (secs, tokens, passes) in stats.items():
    print(f"{name:14s} {tokens / secs:7.1f} tok/s  {tokens / secs / base:.3f}x plain  tau {tokens / passes:.3f}")
