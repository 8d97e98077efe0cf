"""Whole-pass cost of the invariant attention vs PyTorch's: decode step and 9-token pass, contexts 128/512."""
import time, torch
from specloom.loading import load_target
m, tok = load_target("smollm2-135m", "bf16", progress=False, kernel="onednn")
V = m.config.vocab_size
res = {}
with torch.inference_mode():
    for ctx in (128, 512):
        kv = m.new_kv(ctx + 20)
        m(torch.randint(0, V, (1, ctx)), torch.arange(ctx)[None], kv, num_logits=1); kv.commit()
        for rnd in range(12):
            for inv in (None, False):
                m.invariant_attention = inv
                for w in (1, 9):
                    x = torch.randint(0, V, (1, w)); pos = torch.arange(ctx, ctx + w)[None]
                    t = time.perf_counter(); m(x, pos, kv, num_logits=1); dt = time.perf_counter() - t
                    kv.truncate(ctx)
                    if rnd: res.setdefault((ctx, inv, w), []).append(dt)
for ctx in (128, 512):
    for w in (1, 9):
        a, b = min(res[(ctx, None, w)]) * 1e3, min(res[(ctx, False, w)]) * 1e3
        print(f"context {ctx}, {w}-token pass: invariant attention {a:.2f} ms, PyTorch SDPA {b:.2f} ms ({a / b:.3f}x)")
