"""MXFP4 (OCP microscaling): E2M1 codes two per byte (low nibble first), one E8M0 scale byte per 32 values along
K; `w = e2m1 * 2^(b - 127)`.

* dense linear (gpt-oss style): `weight_blocks` U8 [N, K/32, 16] + `weight_scales` U8 [N, K/32] (+ `bias`);
* DeepSeek-V4: `weight` int8 [N, K/2] + `scale` float8_e8m0fnu (or U8) [N, K/32];
* gpt-oss's fused experts (`*_blocks` [E, N, K/32, 16], `*_scales` [E, N, K/32]): `dequantize_experts`.
"""

from __future__ import annotations

import torch

from ..errors import SpecloomError
from .lowbit import e2m1_unpack, e8m0_decode
from .quant_base import QuantFormat, check, describe

_BYTES = (torch.uint8, torch.int8)
_E8M0 = (torch.uint8, torch.float8_e8m0fnu)


def _dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] code bytes and [..., G] E8M0 bytes -> [..., G * 32] fp32."""
    vals = e2m1_unpack(blocks) * e8m0_decode(scales).unsqueeze(-1)
    return vals.reshape(*vals.shape[:-2], -1)


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, name: str = "experts") -> torch.Tensor:
    """gpt-oss fused experts: `blocks` U8 [E, N, K/32, 16], `scales` U8 [E, N, K/32] -> fp32 [E, N, K], each
    expert's weight in nn.Linear's [out, in] convention (gpt-oss's own matmul uses the transpose)."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.dtype not in _BYTES:
        raise SpecloomError(f"{name}_blocks is {describe(blocks)} (expected uint8 [E, N, K/32, 16])")
    if tuple(scales.shape) != tuple(blocks.shape[:3]) or scales.dtype not in _E8M0:
        raise SpecloomError(f"{name}_scales is {describe(scales)} (expected uint8 {list(blocks.shape[:3])})")
    return _dequant(blocks, scales)


class MXFP4Format(QuantFormat):
    name = "mxfp4"
    config_names = ("MXFP4", "W4A8_MXFP4_FP8", "W4A16_MXFP4")
    description = ("MXFP4 `weight_blocks` U8 [N, K/32, 16] + `weight_scales` U8 [N, K/32], or DeepSeek-V4's "
                   "`weight` int8 [N, K/2] + `scale` E8M0 [N, K/32]")

    def _layout(self, tensors) -> str | None:
        if "weight_blocks" in tensors or "weight_scales" in tensors:
            return "blocks"
        w = tensors.get("weight")
        if "scale" in tensors and isinstance(w, torch.Tensor) and w.dtype in _BYTES:
            return "deepseek"
        return None

    def problems(self, module, tensors, params):
        layout = self._layout(tensors)
        if layout is None:
            return None
        if layout == "deepseek":
            out = self.stray(tensors, frozenset(("weight", "scale", "bias"))) + check(tensors, "weight", (torch.int8, torch.uint8), None, "int8 [N, K/2]")
            if out:
                return out
            w = tensors["weight"]
            if w.dim() != 2 or w.shape[1] % 16:
                return [f"weight is {describe(w)} (expected int8 [N, K/2] with K a multiple of 32)"]
            n, half = w.shape
            return check(tensors, "scale", _E8M0, (n, half * 2 // 32), "E8M0, one per 32 of K")
        out = self.stray(tensors, frozenset(("weight_blocks", "weight_scales", "bias"))) + check(tensors, "weight_blocks", (torch.uint8,), None, "uint8 [N, K/32, 16]")
        if out:
            return out
        b = tensors["weight_blocks"]
        if b.dim() != 3 or b.shape[-1] != 16:
            return [f"weight_blocks is {describe(b)} (expected uint8 [N, K/32, 16])"]
        return check(tensors, "weight_scales", _E8M0, tuple(b.shape[:2]), "uint8 E8M0, one per 32 of K")

    def pack(self, module, tensors, params):
        if self._layout(tensors) == "deepseek":
            w = tensors["weight"]
            q = {"blocks": w.view(torch.uint8).reshape(w.shape[0], -1, 16),
                 "scales": tensors["scale"].view(torch.uint8)}
        else:
            q = {"blocks": tensors["weight_blocks"], "scales": tensors["weight_scales"].view(torch.uint8)}
        if "bias" in tensors:
            q["bias"] = tensors["bias"]
        return q, {"group": 32}

    def dequantize(self, q, meta):
        return _dequant(q["blocks"], q["scales"])
