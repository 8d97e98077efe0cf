"""A 512-token prefill of SmolLM2 bf16 (onednn linears, one thread) with the invariant attention and with PyTorch's,
interleaved, fastest of 2 each."""
import time, torch
from specloom.loading import load_target
torch.set_num_threads(1)
m, tok = load_target("smollm2-135m", "bf16", progress=False, kernel="onednn")
ids = torch.randint(0, 49152, (1, 512))
for inv in (True, False, True, False):
    m.invariant_attention = None if inv else False
    best = 1e9
    for _ in range(2):
        kv = m.new_kv(600)
        t = time.perf_counter()
        with torch.inference_mode():
            m(ids, torch.arange(512)[None], kv, num_logits=1)
        best = min(best, time.perf_counter() - t)
    print("invariant" if inv else "sdpa", f"{best*1000:.0f} ms for a 512-token prefill")
