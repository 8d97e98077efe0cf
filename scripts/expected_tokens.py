"""Under a speculation mode, per kind of step (a depth k, a probe, a free draft): steps, tokens emitted per step
and what the geometric run at the row's acceptance expected; then the policy's optimism and its decayed sums
(expected tokens, emitted, predicted cost, measured cost, rows). 26 Spec-Bench prompts, 128 tokens, 2 threads.

    python scripts/expected_tokens.py '{"method": "eagle3", "suffix_decoding": true}' auto [attr=v,...]
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import specloom.engine as engine
import specbench_prompts
from specloom import depth
torch.set_num_threads(2)
prompts = specbench_prompts.prompts(2)
C = sys.argv[1]; spec = sys.argv[2]
eng = engine.load("smollm2-135m", C, speculation=spec, progress=False)
pol = eng.depth_policy()
for kv in filter(None, (sys.argv[3] if len(sys.argv) > 3 else "").split(",")):
    k, v = kv.split("="); setattr(pol, k, type(getattr(pol, k))(float(v)))
obs0 = depth.DepthPolicy.observe
stat = collections.defaultdict(lambda: [0, 0, 0.0])
def observe(self, rows, plan, rep):
    k = plan.depths[0]
    kind = "free" if 0 in plan.free else ("probe" if 0 in plan.probed else f"k{k}")
    s = stat[kind]; s[0] += 1; s[1] += 1 + rep.accepted[0]; s[2] += depth.geometric_tokens(plan.alphas[0], k)
    return obs0(self, rows, plan, rep)
depth.DepthPolicy.observe = observe
for p in prompts:
    eng.generate(prompt=p, max_tokens=128, chat=True)
for k, (n, tok, exp) in sorted(stat.items()):
    print(f"{k:6s} steps {n:5d} tokens/step {tok/n:.2f} expected {exp/n:.2f}")
print("optimism", round(pol.optimism(), 3), "exp/got", [round(x, 1) for x in pol._drafted])
