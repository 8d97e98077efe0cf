"""Batch-invariant attention on CPUs (kernels/invariant_attention.c): each query's result depends only on the keys
it sees, in slot order, never on how many queries or key slots the pass holds.

PyTorch's CPU `scaled_dot_product_attention` blocks its work by the shapes of the pass, so a position decoded
alone (one query over every committed slot) and the same position inside a verification pass (nine queries
under a causal or tree mask) round differently; in bf16 a near-tie of the target's top two logits then parts
speculative output from plain decoding (measured: 8 of 21 prompts identical). With this kernel (and a linear
kernel that is itself batch-invariant: oneDNN's packed bf16 on hosts that run it, `invariant` elsewhere) every
layer computes a position the same way in a decode step, a chain or tree verification, a catch-up or a prefill
chunk, and greedy speculative output is plain output bit for bit.

    out = attend(q (B, H, T, D), keys (B, Hkv, S, D), values, mask (B, 1, T, S) bool | None, scale)

`mask` None: query t sees slots [0, S - T + t] (the pass's entries are each row's last). Keys/values fp32 or bf16
(other stored types are widened to fp32 first); the result is fp32. Unavailable (no AVX2, no compiler,
`SPECLOOM_INVARIANT_KERNEL=0`): `available()` is False and models keep PyTorch's attention.
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from .native import load_kernel

_state: dict = {}


def _chunk(queries: int, threads: int) -> int:
    """Query rows per task (1..8): large enough to share each key's loads, small enough for every thread to have
    work. The result never depends on it."""
    return max(1, min(8, -(-queries // (3 * threads))))


def supports(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 512


def _call(fn, q, keys, values, mask, scale) -> torch.Tensor:
    B, H, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    if keys.dtype not in (torch.float32, torch.bfloat16) or keys.dtype != values.dtype:
        keys, values = keys.float(), values.float()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    q = q.to(torch.float32).contiguous()
    out = torch.empty(B, H, T, D, dtype=torch.float32)
    threads = torch.get_num_threads()
    if mask is not None:
        mask = mask.expand(B, 1, T, S)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mptr, msb, mst = mask.data_ptr(), mask.stride(0), mask.stride(2)
    else:
        mptr, msb, mst = None, 0, 0
    rc = fn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), int(keys.dtype == torch.bfloat16),
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            mptr, msb, mst, out.data_ptr(), B, H, Hkv, T, S, D, float(scale), _chunk(B * H * T, threads), threads)
    if rc != 0:
        raise MemoryError("invariant attention kernel: could not allocate its per-thread scratch")
    return out


def _self_check(fn) -> str | None:
    """Against PyTorch's attention (fp32, tolerance), and each query alone against the same query in the pass."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 4, 2, 5, 37, 24
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) < 0.7
    mask[..., 0] = True
    for kv in ((k, v), (k.bfloat16(), v.bfloat16())):
        for m in (mask, None):
            y = _call(fn, q, *kv, m, 0.3)
            ref = F.scaled_dot_product_attention(q, kv[0].float(), kv[1].float(), attn_mask=m, scale=0.3,
                                                 is_causal=False, enable_gqa=True) if m is not None else None
            if m is None:
                causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
                ref = F.scaled_dot_product_attention(q, kv[0].float(), kv[1].float(), attn_mask=causal,
                                                     scale=0.3, enable_gqa=True)
            if not torch.allclose(y, ref, atol=1e-5, rtol=1e-4):
                return f"self-check: max error {(y - ref).abs().max().item():.2e}"
            for t in range(T):  # query t alone, over only the slots it may see
                sub = None if m is None else m[:, :, t:t + 1]
                keys, vals = kv if m is not None else (kv[0][:, :, :S - T + t + 1], kv[1][:, :, :S - T + t + 1])
                if not torch.equal(_call(fn, q[:, :, t:t + 1], keys, vals, sub, 0.3), y[:, :, t:t + 1]):
                    return "self-check: a query alone differs from the same query in a pass"
    return None


def _load():
    P, L = ctypes.c_void_p, ctypes.c_int64
    return load_kernel(_state, "invariant_attention.c", "invariant_attention",
                       [P, P, P, ctypes.c_int, L, L, L, L, L, L, P, L, L, P, L, L, L, L, L, L, ctypes.c_float,
                        ctypes.c_int, ctypes.c_int], _self_check)


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state.get("why")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None = None) -> torch.Tensor:
    fn = _load()
    if fn is None:
        raise RuntimeError(f"the invariant attention kernel is unavailable: {unavailable_reason()}")
    return _call(fn, q, keys, values, mask, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
