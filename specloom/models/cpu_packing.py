"""Pre-packed bf16 weights for CPU decoding.

oneDNN reads a weight reordered into its blocked layout ~35 % faster than a plain `[out, in]` tensor when a
decode step multiplies one row (measured here: 16.4 ms vs 25.4 ms for SmolLM2-135M's matmuls). For bf16 the
packed product matched `F.linear` bit for bit on every shape checked. It is *not* guaranteed to be independent of
the number of rows multiplied at once: on real activations a row of a 6-row product (SmolLM2 layer 6 down_proj)
differed in the last bit from the same row alone, so bf16 speculative outputs can part from bf16 plain decoding
at near-ties (see BENCHMARKS.md). fp32 is left alone: its packed path rounds differently from `F.linear`.
"""

from __future__ import annotations

import torch
from torch import nn


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


class PackedLinear(nn.Module):
    """Inference-only stand-in for an `nn.Linear`; keeps the original weight (shared with e.g. a tied embedding,
    and readable by drafters) next to the packed copy."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def pack_linears(model: nn.Module) -> int:
    """Give every `nn.Linear` of `model` (dense weights, e.g. a drafter's) the kernel the weight-format seam picks
    for dense weights (`specloom.loading.formats.dense_kernel`): a `PackedLinear` for bf16 on a CPU that supports
    it. Returns how many were replaced."""
    from ..loading.formats import apply_kernels  # the loader imports this module

    return apply_kernels(model)
