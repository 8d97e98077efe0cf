"""τ and drafted steps of one drafter under `--speculation auto` over 26 Spec-Bench prompts (2 per category, 128
tokens, chat): a loop over `Engine.generate`, for checking what a change to the depth policy does to how often it
drafts (deterministic output; the policy's choices follow measured costs, so run it on a quiet host).

    python scripts/auto_tau.py '{"method": "eagle3", "suffix_decoding": true}' [--policy NAME=VALUE ...]

`--policy` sets attributes of the engine's depth policy first (e.g. explore_base=16).
"""
import argparse
import json
import os

import torch

import specloom.engine as engine

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("--policy", nargs="*", default=[])
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
per = {}
for r in map(json.loads, open(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval",
                                           "spec_bench.jsonl"))):
    per.setdefault(r["category"], []).append(r)
prompts = [r["turns"][0] for rows in per.values() for r in rows[:2]]
eng = engine.load("smollm2-135m", a.config, speculation="auto", progress=False)
for kv in a.policy:
    name, value = kv.split("=", 1)
    setattr(eng.depth_policy(), name, type(getattr(eng.depth_policy(), name))(float(value)))
tokens = passes = drafted = steps = 0
for p in prompts:
    r = eng.generate(prompt=p, max_tokens=128, chat=True)
    tokens += len(r.token_ids)
    passes += r.num_target_passes
    drafted += r.speculation["drafted_steps"]
    steps += r.speculation["steps"]
print(f"{a.config} {' '.join(a.policy)}: tau {tokens / passes:.3f}, drafted steps {drafted}/{steps}, "
      f"{len(prompts)} prompts")
