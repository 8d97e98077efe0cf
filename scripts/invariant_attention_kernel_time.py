"""Kernel alone: PyTorch SDPA vs the invariant attention kernel, one thread, 9 heads over 3 KV heads, d 64,
for decode (1 query) and 9-query causal passes at 128/512/1024 keys (fastest of 5 x 300 calls)."""
import torch, time, torch.nn.functional as F
from specloom.models.invariant_attention import attend
torch.set_num_threads(1)
def t(f, n=300):
    for _ in range(10): f()
    best = 1e9
    for _ in range(5):
        a = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - a) / n)
    return best * 1e6
for S in (128, 512, 1024):
    for T in (1, 9):
        q = torch.randn(1, 9, T, 64); k = torch.randn(1, 3, S, 64); v = torch.randn(1, 3, S, 64)
        m = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None]
        if T == 1:
            sd = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            sd = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        inv = lambda: attend(q, k, v, None if T == 1 else m)
        print(f"S={S} T={T}: sdpa {t(sd):.1f} us  invariant {t(inv):.1f} us")
