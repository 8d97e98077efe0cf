"""CPU linear kernels for the target: which one runs each pass is chosen per host by a measured probe.

Kernels (names used by `--linear-kernel`, the probe and reports):
* `onednn` -- bf16 weight pre-packed into oneDNN's blocked layout (`PackedLinear`), on a CPU whose oneDNN runs
  bf16 (AVX512-BF16 / AMX). Measured here ~35 % faster than a plain `[out, in]` bf16 tensor for one row (16.4 ms
  vs 25.4 ms for SmolLM2-135M's matmuls), and a pass over 9 rows costs about as much as one. Bit-identical to
  `F.linear` per product on every shape checked (the probe checks again on each host).
* `invariant` -- a batch-invariant AVX2/FMA kernel built on first use (`models/invariant_linear.py`): each weight
  row is read once for all rows of a pass, and every product has the same bits whatever the row count, so it runs
  plain and speculative passes alike and speculative output is plain output bit for bit. bf16 or fp32 weights,
  fp32 accumulation (the numerics class of `onednn`). Measured on an AVX2-only host: a bf16 pass over 8 rows
  ~2x one row, where `native` takes ~7x (BENCHMARKS.md).
* `native` -- `F.linear` on the weight as loaded. On an AVX2-only CPU this is the only bf16 kernel: there, a
  bf16 product over n rows costs about n single-row products.
* `fp32` -- an fp32 copy of the weight (`Fp32Linear`; output cast back to the activations' dtype). Memory-bound,
  so cheap for many rows on AVX2 hosts, but for a bf16 model it changes the target's numerics (a different
  accumulation): never chosen by default, only `--linear-kernel fp32`, and then for every pass.
* `int8` -- weight-only int8 with a per-output-channel scale through `torch._weight_int8pack_mm` (`Int8Linear`).
  It changes the target's numerics: only `--linear-kernel int8`, never a default.

Exactness: greedy speculative output must be the plain output under the same settings, so one kernel runs both
plain and speculative passes -- or two that gave bit-identical products on the probe (`RowSplitLinear`: one for
single-row passes, one for multi-row passes). Caveat that holds for any single kernel: a product is not
guaranteed to be independent of the number of rows multiplied at once (on real activations a row of a 6-row bf16
product, SmolLM2 layer 6 down_proj, differed in the last bit from the same row alone), so bf16 speculative outputs
can part from bf16 plain decoding at near-ties (see BENCHMARKS.md); fp32 models are exact in the tests. fp32
weights are never packed: oneDNN's packed fp32 path rounds differently from `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("onednn", "invariant", "native", "fp32", "int8")
NUMERICS_CHANGING = ("fp32", "int8")  # for a bf16/fp16 model (fp32 on an fp32 model is `native`)


def onednn_bf16_supported() -> bool:
    """Whether this CPU's oneDNN runs bf16 matmuls (it needs AVX512-BF16/AMX or AVX-NE-CONVERT)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """bf16 weights on a CPU whose oneDNN supports bf16; never another dtype or device (CUDA, meta, ...)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and onednn_bf16_supported()


def int8_supported() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


def kernel_available(name: str, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether kernel `name` can run a weight of `dtype` on `device`."""
    dev = torch.device(device)
    if name == "native":
        return True
    if dev.type != "cpu":
        return False
    if name == "onednn":
        return packing_supported(dtype, dev)
    if name == "invariant":
        from . import invariant_linear

        return dtype in (torch.bfloat16, torch.float32) and invariant_linear.available()
    if name == "fp32":
        return dtype in (torch.bfloat16, torch.float16)  # on fp32 weights it would be `native`
    if name == "int8":
        return int8_supported() and dtype in (torch.bfloat16, torch.float16, torch.float32)
    return False


def changes_numerics(name: str, dtype: torch.dtype) -> bool:
    """Whether kernel `name` computes something else than `F.linear` on the model's own weights would."""
    return name in NUMERICS_CHANGING and not (name == "fp32" and dtype == torch.float32)


class PackedLinear(nn.Module):
    """Inference-only stand-in for an `nn.Linear`; keeps the original weight (shared with e.g. a tied embedding,
    and readable by drafters) next to the packed copy."""

    kernel = "onednn"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


class Fp32Linear(nn.Module):
    """fp32 copy of a bf16/fp16 weight; activations are upcast (exactly) and the output cast back."""

    kernel = "fp32"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # the originals (drafters read them)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.w32 = linear.weight.detach().float()
        self.b32 = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.w32, self.b32).to(x.dtype)


class Int8Linear(nn.Module):
    """Weight-only int8: symmetric per-output-channel scale (max |w| / 127), `torch._weight_int8pack_mm`."""

    kernel = "int8"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.qweight,
                                      self.scale.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class RowSplitLinear(nn.Module):
    """Two kernels that gave bit-identical products on the probe: `single` for single-row passes (plain
    decoding), `multi` for passes over several rows (verification, prefill, batches)."""

    def __init__(self, linear: nn.Linear, single: nn.Module, multi: nn.Module):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.single, self.multi = single, multi
        self.kernel = f"{getattr(single, 'kernel', 'native')}+{getattr(multi, 'kernel', 'native')}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.single if x.numel() == x.shape[-1] else self.multi)(x)


def build_kernel(name: str, linear: nn.Linear) -> nn.Module:
    """The module that runs `linear` with kernel `name` (`native`: the linear itself; `ggml` runs the weights a
    GGUF ships as blocks (models/ggml_linear.py); a dense linear beside them gets the default dense kernel)."""
    if name == "native":
        return linear
    if name == "ggml":
        return dense_kernel(linear)
    if name == "invariant":
        from .invariant_linear import InvariantLinear

        return InvariantLinear(linear)
    cls = {"onednn": PackedLinear, "fp32": Fp32Linear, "int8": Int8Linear}.get(name)
    if cls is None:
        raise ValueError(f"unknown linear kernel {name!r} ({', '.join(KERNELS)})")
    return cls(linear)


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a linear (any kernel's module) computes in, without touching its weight: a module held as GGUF
    blocks (models/ggml_linear.py) would dequantise its whole weight to answer `.weight.dtype`."""
    dt = getattr(module, "dtype", None)
    return dt if isinstance(dt, torch.dtype) else module.weight.dtype


def kernel_of(module: nn.Module) -> str:
    """The kernel name a (replaced) linear runs."""
    return getattr(module, "kernel", "native")


def dense_kernel(linear: nn.Linear, device: torch.device | str | None = None, choice=None) -> nn.Module:
    """The kernel for a dense `nn.Linear` that runs on `device` (default: where its weight is). With a `choice`
    (a `KernelChoice`: `single` and `multi` kernel names) its kernels, one module or a `RowSplitLinear`; without
    one the oneDNN pre-packed bf16 layout on a CPU that supports it (bit-identical to `F.linear` per product,
    faster when decoding), the plain `nn.Linear` everywhere else."""
    device = linear.weight.device if device is None else torch.device(device)
    if choice is not None and device.type == "cpu":
        single = build_kernel(choice.single, linear)
        if choice.multi == choice.single:
            return single
        return RowSplitLinear(linear, single, build_kernel(choice.multi, linear))
    if packing_supported(linear.weight.dtype, device):
        return PackedLinear(linear)
    return linear


def replace_linears(model: nn.Module, make) -> int:
    """Replace every plain `nn.Linear` of `model` by `make(full_name, linear)` (the same module: kept). Returns
    how many were replaced. The one walk behind `pack_linears` and the loader's `apply_kernels`."""
    count = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            new = make(f"{prefix}.{name}" if prefix else name, child)
            if new is not child:
                setattr(parent, name, new)
                count += 1
    return count


def pack_linears(model: nn.Module) -> int:
    """Give every `nn.Linear` of a drafter `model` its drafting kernel (`draft_kernel`). Returns how many were
    replaced. (A drafter's numerics change only its acceptance, never the output.)"""
    return replace_linears(model, lambda name, linear: draft_kernel(linear))


class DraftQ8Linear(nn.Module):
    """Inference-only stand-in for a drafter's bf16 `nn.Linear`: its weight also held as GGML Q8_0 blocks (one fp16
    scale per 32 weights, models/ggml_linear.py) and run by the repacked GGML kernel (AMX / AVX512-BF16). A drafting
    pass reads every drafter weight once and, like a decode step, is bound by those reads: Q8_0 reads 17/32 of
    bf16's bytes (measured, issue 39: EAGLE-3's drafting 4.1 -> 3.0 ms a step on SmolLM2-135M, acceptance the
    same). The original weight stays (state dicts, export and warm starts read it); a pass that needs gradients
    runs it."""

    kernel = "q8_0"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from .ggml_linear import KERNEL_TYPES, GGMLLinear, quantize_q8_0

        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.q8 = GGMLLinear([(quantize_q8_0(linear.weight), KERNEL_TYPES["Q8_0"])], linear.in_features,
                             torch.bfloat16, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or (self.weight is not None and self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        return self.q8(x)


def q8_drafting_supported(linear: nn.Linear) -> bool:
    """Whether a drafter linear runs as Q8_0 here: bf16 on a CPU with the repacked GGML path, rows of a multiple of
    32 weights, and not turned off (`SPECLOOM_DRAFTER_Q8=0` keeps drafters in bf16)."""
    import os

    if os.environ.get("SPECLOOM_DRAFTER_Q8", "1") == "0" or linear.in_features % 32 \
            or linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
        return False
    from . import ggml_linear

    return ggml_linear.available() and ggml_linear.repacked_path()


def draft_kernel(linear: nn.Linear) -> nn.Module:
    """The kernel a drafter's dense linear runs while drafting: `DraftQ8Linear` where supported (half the bytes),
    else the kernel dense weights get (`dense_kernel`)."""
    return DraftQ8Linear(linear) if q8_drafting_supported(linear) else dense_kernel(linear)
