"""RMSNorm (with the residual add fused in), RoPE and the gated MLP's silu(gate) * up for bf16 inference on CPUs,
one C call each (kernels/layer_ops.c) instead of PyTorch's 5-9 small ops, and the element-wise bf16 steps the fused
decoder stack needs (models/fused_stack.py): a decode step of SmolLM2-135M makes ~60 norms and 30
RoPEs, and at ~25 us per eager RMSNorm those were ~1.5 ms of a ~18 ms step (issue 37, "a lean step").

Used where `usable(x)`: a bf16 CPU tensor outside autograd, the kernel built. Elsewhere (fp32 models, training,
CUDA) the layers keep PyTorch's ops. RoPE here is bit for bit `layers.apply_rope`; the norm computes as
`F.rms_norm` does for bf16 (fp32 inside, one rounding), with its own fixed per-row summation order for the mean
(so now and then one last bit differs from PyTorch's): batch-invariant either way.
`SPECLOOM_INVARIANT_KERNEL=0` disables it with the other built kernels.
"""

from __future__ import annotations

import ctypes

import torch

from .native import load_kernel

_norm: dict = {}
_rope: dict = {}
_silu: dict = {}
_conv: dict = {}  # add_bf16, f32_to_bf16, bf16_to_f32: the fused decoder stack's element-wise steps
P, L = ctypes.c_void_p, ctypes.c_int64


def _check_norm(fn) -> str | None:
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 40, generator=g).bfloat16(), torch.randn(3, 40, generator=g).bfloat16()
    w = torch.randn(40, generator=g)
    h, out = torch.empty_like(x), torch.empty_like(x)
    fn(x.data_ptr(), r.data_ptr(), h.data_ptr(), out.data_ptr(), w.data_ptr(), 3, 40, ctypes.c_float(1e-6))
    ref_h = x + r
    ref = torch.nn.functional.rms_norm(ref_h.float(), (40,), w, 1e-6)
    if not torch.equal(h, ref_h) or not torch.allclose(out.float(), ref, atol=0.02, rtol=0.01):
        return "self-check: rms_norm differs from PyTorch's"
    return None


def _check_rope(fn) -> str | None:
    from .layers import apply_rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 3, 8, generator=g).bfloat16()
    cos, sin = torch.randn(1, 2, 1, 8, generator=g).bfloat16(), torch.randn(1, 2, 1, 8, generator=g).bfloat16()
    ref = apply_rope(x, cos, sin)
    y = x.clone()
    fn(y.data_ptr(), 2, 24, 3, 8, cos.data_ptr(), sin.data_ptr())
    return None if torch.equal(y, ref) else "self-check: rope differs from layers.apply_rope"


def _check_silu(fn) -> str | None:
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(3, 2, 40, generator=g) * 4).bfloat16()
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    fn(gu.data_ptr(), 3, 40, out.data_ptr())
    ref = torch.nn.functional.silu(gu[:, 0].float()) * gu[:, 1].float()
    return None if torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2) else "self-check: silu_mul differs"


def _fns():
    norm = load_kernel(_norm, "layer_ops.c", "rms_norm_bf16", [P, P, P, P, P, L, L, ctypes.c_float], _check_norm)
    rope = load_kernel(_rope, "layer_ops.c", "rope_bf16", [P, L, L, L, L, P, P], _check_rope)
    silu = load_kernel(_silu, "layer_ops.c", "silu_mul_bf16", [P, L, L, P], _check_silu)
    return norm, rope, silu


def _check_conv(fns) -> str | None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, generator=g).bfloat16(), torch.randn(37, generator=g).bfloat16()
    x = a.clone()
    fns["add_bf16"](x.data_ptr(), b.data_ptr(), 37)
    f = torch.randn(37, generator=g) * 100
    y = torch.empty(37, dtype=torch.bfloat16)
    fns["f32_to_bf16"](f.data_ptr(), y.data_ptr(), 37)
    z = torch.empty(37)
    fns["bf16_to_f32"](a.data_ptr(), z.data_ptr(), 37)
    ok = torch.equal(x, a + b) and torch.equal(y, f.bfloat16()) and torch.equal(z, a.float())
    return None if ok else "self-check: an element-wise bf16 kernel differs from PyTorch's"


def elementwise() -> dict | None:
    """{"add_bf16", "f32_to_bf16", "bf16_to_f32"}: C functions (kernels/layer_ops.c) checked against PyTorch's
    ops bit for bit, or None where they do not build."""
    if not _conv:
        first = load_kernel(_conv, "layer_ops.c", "add_bf16", [P, P, L], lambda fn: None)
        if first is None:
            _conv["fns"] = None
        else:
            from .native import _open, compiler

            lib = _open(compiler(), "layer_ops.c")
            fns = {}
            for name in ("add_bf16", "f32_to_bf16", "bf16_to_f32"):
                f = getattr(lib, name)
                f.restype, f.argtypes = ctypes.c_int, [P, P, L]
                fns[name] = f
            why = _check_conv(fns)
            _conv["fns"] = None if why else fns
    return _conv["fns"]


_ready: list[bool] = []  # [built and checked], once per process


def usable(x: torch.Tensor) -> bool:
    if x.dtype is not torch.bfloat16 or x.is_cuda or (x.requires_grad and torch.is_grad_enabled()) \
            or x.shape[-1] > 16384 or x.device.type != "cpu":
        return False
    if not _ready:
        _ready.append(all(f is not None for f in _fns()))
    return _ready[0]


def rms_norm(x: torch.Tensor, w32: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """bf16 RMSNorm of x (or of h = x + residual, returned too: (h, normed))."""
    fn = _fns()[0]
    H = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        fn(x.data_ptr(), None, None, out.data_ptr(), w32.data_ptr(), x.numel() // H, H, eps)
        return out
    residual = residual.contiguous()
    h = torch.empty_like(x)
    fn(x.data_ptr(), residual.data_ptr(), h.data_ptr(), out.data_ptr(), w32.data_ptr(), x.numel() // H, H, eps)
    return h, out


def version(t: torch.Tensor) -> int:
    """t's in-place version counter (0 for an inference tensor, which cannot be changed in place)."""
    return 0 if t.is_inference() else t._version


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """bf16 silu(gate) * up of a fused gate/up output gu (..., 2I): (..., I)."""
    I = gu.shape[-1] // 2
    gu = gu.contiguous()
    out = torch.empty(*gu.shape[:-1], I, dtype=gu.dtype)
    _fns()[2](gu.data_ptr(), gu.numel() // (2 * I), I, out.data_ptr())
    return out


def rope_(qkv: torch.Tensor, nrot: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first `nrot` heads of qkv (B, T, heads, d) bf16 in place; False (nothing done) when the layout
    does not allow it (the caller then uses `layers.apply_rope`)."""
    B, T, _, d = qkv.shape
    if (qkv.stride(-1) != 1 or qkv.stride(-2) != d or qkv.stride(0) != T * qkv.stride(1) or cos.dtype != qkv.dtype
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.numel() != B * T * d
            or sin.numel() != B * T * d):
        return False
    _fns()[1](qkv.data_ptr(), B * T, qkv.stride(1), nrot, d, cos.data_ptr(), sin.data_ptr())
    return True
