"""The `invariant` linear kernel: a batch-invariant AVX2/FMA matmul, built on first use with the C compiler.

Why: on an AVX2-only CPU (no oneDNN bf16) PyTorch's bf16 `F.linear` over n rows costs about n single-row
products, and MKL's fp32 sgemm for 2-16 rows costs 2-4x its one-row GEMV, so verifying a draft costs several
plain steps and speculation cannot pay (BENCHMARKS.md, "host"). This kernel reads each weight row once per call
for all rows of x and computes every product y[m, n] by the same operation sequence whatever the number of rows
(kernels/invariant_linear.c): one row alone and the same row in a 9-row verification pass give the same bits. So
it runs every pass -- plain decoding, verification, prefill -- and speculative output is plain output bit for bit,
which no kernel that changes its reduction with the row count can promise.

Numerics: bf16 (or fp32) weights, activations widened to fp32 (exact), fp32 accumulation, output rounded to the
activations' dtype -- the same class as oneDNN's bf16 path; not bit-identical to `F.linear` (another summation
order), so the probe (host/kernel_choice.py) lists it with the exact kernels and it is chosen by measured speed.

The shared object is compiled once per source and compiler into ~/.cache/specloom/kernels/ (`cc`, or $CC, with
-O3 -mavx2 -mfma -fopenmp; about a second) and checked on a small product before use. No compiler, no AVX2 or a
failed check: the kernel is unavailable (`unavailable_reason()`), never an error, and the other kernels run.
`SPECLOOM_INVARIANT_KERNEL=0` disables it.
"""

from __future__ import annotations

import ctypes
import shutil  # noqa: F401 (tests patch shutil.which through this module)

import torch
import torch.nn.functional as F
from torch import nn

from .native import load_kernel

_state: dict = {}  # "fn": the ctypes function, or "why": the reason it is unavailable


def _self_check(fn) -> str | None:
    """A small product against F.linear (fp32, tolerance) and against itself one row at a time (bit for bit)."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((37, 77), (64, 96)):
        w = torch.randn(n, k, generator=g)
        x = torch.randn(5, k, generator=g)
        b = torch.randn(n, generator=g)
        for wt in (w, w.bfloat16()):
            y = _call(fn, x, wt, b)
            ref = F.linear(x, wt.float(), b)
            if not torch.allclose(y, ref, atol=1e-4, rtol=1e-4):
                return f"self-check: max error {(y - ref).abs().max().item():.2e}"
            if not all(torch.equal(_call(fn, x[i:i + 1], wt, b), y[i:i + 1]) for i in range(5)):
                return "self-check: a row alone differs from the same row in a batch"
    return None


def _load():
    P, L = ctypes.c_void_p, ctypes.c_int64
    return load_kernel(_state, "invariant_linear.c", "invariant_linear",
                       [P, P, ctypes.c_int, P, P, L, L, L, ctypes.c_int], _self_check)


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state.get("why")


def _call(fn, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 y = x @ w^T + bias for a 2-D fp32 contiguous x, a contiguous bf16/fp32 w and an fp32 bias."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = fn(x.data_ptr(), w.data_ptr(), int(w.dtype == torch.bfloat16),
            None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("invariant linear kernel: could not allocate its per-thread buffer")
    return y


class InvariantLinear(nn.Module):
    """Inference stand-in for an `nn.Linear` running the batch-invariant kernel; keeps the original weight
    (shared with e.g. a tied embedding, and readable by drafters)."""

    kernel = "invariant"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        fn = _load()
        if fn is None:
            raise RuntimeError(f"the invariant linear kernel is unavailable: {unavailable_reason()}")
        self._fn = fn
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        if w.dtype not in (torch.bfloat16, torch.float32):
            w = w.float()
        self.w = w.contiguous()
        self.b32 = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = _call(self._fn, x2, self.w, self.b32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
