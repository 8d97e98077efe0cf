"""The depth policy's state after each of 26 Spec-Bench prompts (2 per category, 128 tokens, chat, `auto`, 2
threads) through one engine: τ and drafted steps per prompt, `optimism`, the drafting cost, the running
acceptance, and whether any acceptance could pay (`pays_alone(1.0)`). Shows a run of `auto` that stops drafting
for good, and what brings it back (BENCHMARKS.md, sixteenth session; run beside other work to see it).

    python scripts/auto_trace.py '{"method": "eagle3", "suffix_decoding": true}'
"""
import sys

import torch

import specloom.engine as engine
import specbench_prompts

torch.set_num_threads(2)
eng = engine.load("smollm2-135m", sys.argv[1], speculation="auto", progress=False)
pol = eng.depth_policy()
print("curve c(1, t):", [round(pol.cost(1, t), 3) for t in range(1, 10)], "prior alpha", round(pol.prior_alpha, 3))
tokens = passes = drafted = 0
for i, p in enumerate(specbench_prompts.prompts(2)):
    r = eng.generate(prompt=p, max_tokens=128, chat=True)
    tokens, passes, drafted = tokens + len(r.token_ids), passes + r.num_target_passes, \
        drafted + r.speculation["drafted_steps"]
    print(f"{i:2d} tau {len(r.token_ids) / r.num_target_passes:.2f} drafted {r.speculation['drafted_steps']}/"
          f"{r.speculation['steps']}  optimism {pol.optimism():.3f}  drafting cost {pol.draft_cost:.3f}  "
          f"alpha {pol.global_alpha.alpha:.3f}  any acceptance pays: {pol.pays_alone(1.0, pol.max_k)}", flush=True)
print(f"tau {tokens / passes:.3f}, {drafted} drafted steps")
