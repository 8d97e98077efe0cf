"""How much a one-row verify-cost measurement's shape varies: passes over 1 / 2 / 3 / 5 / 9 tokens after CTX cached
tokens, timed back to back (11 rounds, fastest kept), repeated for each CTX given, in one process; prints each
width in decode steps (BENCHMARKS.md, sixteenth session: ±5-10 % between repeats a minute apart).

    python scripts/curve_repeat.py 128 400 800 128 800
"""
import sys
import time

import torch

import specloom.engine as engine

torch.set_num_threads(2)
model = engine.load("smollm2-135m", None, progress=False).model
V = model.config.vocab_size
with torch.inference_mode():
    for ctx in map(int, sys.argv[1:] or ["128", "128"]):
        kv = model.new_kv(ctx + 20)
        model(torch.randint(0, V, (1, ctx)), torch.arange(ctx)[None], kv, num_logits=1)
        kv.commit()
        inputs = {t: (torch.randint(0, V, (1, t)), torch.arange(ctx, ctx + t)[None]) for t in (1, 2, 3, 5, 9)}
        times: dict = {t: [] for t in inputs}
        for r in range(12):
            for t, (x, pos) in inputs.items():
                s = time.perf_counter()
                model(x, pos, kv)
                took = time.perf_counter() - s
                kv.truncate(ctx)
                if r:
                    times[t].append(took)
        fast = {t: min(v) for t, v in times.items()}
        print(f"context {ctx:4d}:", {t: round(fast[t] / fast[1], 3) for t in fast}, f"1x1 {1000 * fast[1]:.2f} ms")
