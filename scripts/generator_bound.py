"""Costs that bound `specloom data` on this host (BENCHMARKS.md, issue 13 session 7): single-row prefill rate at
64/203/400 tokens, and a 64-row decode step over ragged cached lengths 150-450 (add --profile for the torch profiler table)."""
import time, torch
from specloom.loading import load_target
model, tok = load_target("smollm2-135m", "bf16", device="cpu")
kv = model.new_kv(1024, dtype=torch.bfloat16, batch=1)
with torch.inference_mode():
    for T in (64, 203, 400):
        x = torch.randint(0, 1000, (1, T)); pos = torch.arange(T)[None]
        for _ in range(2):
            model(x, pos, kv.begin([0], [T]), num_logits=1); kv.truncate(0)
        t0 = time.perf_counter(); R = 5
        for _ in range(R):
            model(x, pos, kv.begin([0], [T]), num_logits=1); kv.truncate(0)
        dt = (time.perf_counter() - t0) / R
        print(f"prefill 1 row x {T} tokens: {dt*1e3:.1f} ms, {T/dt:.0f} tokens/s")

import sys

n = 64
kv = model.new_kv(1024, dtype=torch.bfloat16, batch=n)
torch.manual_seed(0)
lens = torch.randint(150, 450, (n,)).tolist()
with torch.inference_mode():
    for b in range(n):
        x = torch.randint(0, 1000, (1, lens[b]))
        model(x, torch.arange(lens[b])[None], kv.begin([b], [lens[b]]), num_logits=1)
        kv.commit(row=b)

    def step():
        pos = torch.tensor([kv.lengths[b] for b in range(n)])[:, None]
        out = model(torch.randint(0, 1000, (n, 1)), pos, kv.begin(range(n), [1] * n))
        out.logits.argmax(-1).tolist()
        kv.commit()

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    print(f"decode step, {n} rows: {(time.perf_counter() - t0) / 10 * 1e3:.1f} ms")
    if "--profile" in sys.argv:
        from torch.profiler import profile

        with profile() as p:
            for _ in range(5):
                step()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
