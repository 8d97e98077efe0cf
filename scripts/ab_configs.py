"""Drafter configurations, each with its own speculation mode and depth-policy attributes, against plain
decoding, interleaved prompt by prompt in one process (the order alternating): tokens/s without prefill, the
ratio to plain decoding, tau, and each engine's EAGLE shape and prior. Spec-Bench prompts: PER per category
(default 2) after the first SKIP (default 0: SKIP=10 is a slice the policy was not tuned on), ROUNDS rounds.

    PER=3 SKIP=10 python scripts/ab_configs.py 'fixed1=fixed={"method": "eagle3", "num_speculative_tokens": 1, "tree_width": 1}' \
        'auto=auto={"method": "eagle3"}' 'auto-z0=auto={"method": "eagle3"}|lifetime_z=0'
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import specloom.engine as engine
import specbench_prompts
torch.set_num_threads(2)
prompts = specbench_prompts.prompts(int(os.environ.get("PER", "2")), int(os.environ.get("SKIP", "0")))
engines = [("plain", engine.load("smollm2-135m", None, progress=False))]
for arg in sys.argv[1:]:
    name, spec, rest = arg.split("=", 2)
    cfg, _, attrs = rest.partition("|")
    e = engine.load("smollm2-135m", cfg, speculation=spec, progress=False)
    pol = e.depth_policy()
    for kv in filter(None, attrs.split(",")):
        k, v = kv.split("=")
        setattr(pol, k, type(getattr(pol, k))(float(v)))
    d = getattr(e.drafter, "inner", e.drafter)
    print(name, "shape", getattr(d, "depth", None), getattr(d, "width", None), getattr(d, "num_nodes", None), "max_k", pol.max_k if pol else None, "prior", round(pol.prior_alpha, 3) if pol else None, flush=True)
    engines.append((name, e))
for _, e in engines:
    e.generate(prompt=prompts[0], max_tokens=32, chat=True)
stats = {name: [0.0, 0, 0] for name, _ in engines}
for rnd in range(int(os.environ.get("ROUNDS", "1"))):
    for i, p in enumerate(prompts):
        for name, e in (engines if (i + rnd) % 2 == 0 else engines[::-1]):
            r = e.generate(prompt=p, max_tokens=128, chat=True)
            s = stats[name]; s[0] += r.total_seconds - r.prefill_seconds; s[1] += len(r.token_ids); s[2] += r.num_target_passes
base = stats["plain"][1] / stats["plain"][0]
for name, (secs, tokens, passes) in stats.items():
    print(f"{name:16s} {tokens / secs:7.1f} tok/s  {tokens / secs / base:.3f}x plain  tau {tokens / passes:.3f}")
