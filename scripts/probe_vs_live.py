"""The one-row verify-cost probe (fastest and median of 12 rounds, 128 cached tokens) against the target's real
passes inside generation (medians per width, in decode steps), in one process: plain, EAGLE-3 depth-1 chain,
EAGLE-3 depth 1 width 2 and n-gram engines over the first prompt of 8 Spec-Bench categories; the probe runs
before each prompt. Run it on a quiet host (with another process on a core both read flat).

    python scripts/probe_vs_live.py
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specbench_prompts  # noqa: E402
import specloom.engine as engine  # noqa: E402
from specloom import step as step_mod
torch.set_num_threads(2)
prompts = specbench_prompts.prompts(1)[:8]
widths = {}
pass0 = step_mod.Stepper._target_pass
def timed(self, tokens, positions, p, mask, capture):
    t = time.perf_counter(); out = pass0(self, tokens, positions, p, mask, capture)
    if tokens.shape[0] == 1 and tokens.shape[1] <= 16:
        widths.setdefault(tokens.shape[1], []).append(time.perf_counter() - t)
    return out
step_mod.Stepper._target_pass = timed
cfgs = [None, '{"method":"eagle3","num_speculative_tokens":1,"tree_width":1}', '{"method":"eagle3","num_speculative_tokens":1,"tree_width":2,"num_draft_tokens":2}', '{"method":"ngram","num_speculative_tokens":4}']
engines = [engine.load("smollm2-135m", c, speculation="fixed", progress=False) for c in cfgs]
model = engines[0].model
V = model.config.vocab_size
def probe(ctx=128, reps=12):
    with torch.inference_mode():
        kv = model.new_kv(ctx + 20)
        model(torch.randint(0, V, (1, ctx)), torch.arange(ctx)[None], kv, num_logits=1); kv.commit()
        inputs = {t: (torch.randint(0, V, (1, t)), torch.arange(ctx, ctx + t)[None]) for t in (1, 2, 3, 5)}
        times = {t: [] for t in inputs}
        for r in range(reps + 1):
            for t, (x, pos) in inputs.items():
                s = time.perf_counter(); model(x, pos, kv); took = time.perf_counter() - s
                kv.truncate(ctx)
                if r: times[t].append(took)
    mn = {t: min(v) for t, v in times.items()}; md = {t: statistics.median(v) for t, v in times.items()}
    return {t: round(mn[t]/mn[1],3) for t in mn}, {t: round(md[t]/md[1],3) for t in md}
for e in engines:
    e.generate(prompt=prompts[0], max_tokens=32, chat=True)
widths.clear()
for i, p in enumerate(prompts):
    print("probe min/median", probe(), flush=True)
    for e in engines:
        e.generate(prompt=p, max_tokens=128, chat=True)
one = statistics.median(widths[1])
for w in sorted(widths):
    m = statistics.median(widths[w]); q = sorted(widths[w])[len(widths[w])//10]
    print(w, len(widths[w]), round(m/one,3), "p10", round(q/sorted(widths[1])[len(widths[1])//10],3))
