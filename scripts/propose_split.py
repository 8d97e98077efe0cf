"""Inside EAGLE-3's `propose` as a depth-1 chain (`fixed`): medians per call of the drafter's pieces -- the layer's
C call, the model's forward around it, the input projection, the embedding, the attention input, RoPE, the
attention context, the head, the draw -- over the first prompt of 8 Spec-Bench categories, 128 tokens, 2 threads.

    python scripts/propose_split.py
"""
import statistics
import time

import torch

import specloom.drafters.eagle.drafter as eagle_drafter
import specloom.drafters.eagle.model as eagle_model
import specloom.engine as engine
import specbench_prompts
from specloom.models import fused_stack

torch.set_num_threads(2)
prompts = specbench_prompts.prompts(1)[:8]
eng = engine.load("smollm2-135m", '{"method": "eagle3", "num_speculative_tokens": 1, "tree_width": 1}',
                  speculation="fixed", progress=False)
T: dict = {}


def wrap(obj, name, key):
    f = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T.setdefault(key, []).append(time.perf_counter() - t)
        return r

    setattr(obj, name, timed)


d, m = eng.drafter, eng.drafter.model
wrap(fused_stack, "_call", "C call (target stack and drafter layer)")
wrap(m.rope, "forward", "rope")
for obj, name in ((eagle_model, "attention_context"), (m.layers[0], "attn_input"),
                  (fused_stack, "run_layer"), (m, "embed"), (m, "forward"), (m, "input_hidden"),
                  (m, "draft_logits"), (eagle_drafter, "draw"), (d, "_catch_up"), (d, "_chain"), (d, "propose")):
    wrap(obj, name, name)
for p in prompts[:2]:
    eng.generate(prompt=p, max_tokens=64, chat=True)  # warm-up
T.clear()
for p in prompts:
    eng.generate(prompt=p, max_tokens=128, chat=True)
for k, v in T.items():
    print(f"{k:40s} n {len(v):5d}  median {1000 * statistics.median(v):.3f} ms")
