"""FP8 E4M3 weights (`float8_e4m3fn`) with fp32 scales, dequantised as `w * scale` (scales are multipliers):

* compressed-tensors: `weight` + `weight_scale` -- a scalar (per tensor), [N, 1] / [N] (per output channel) or
  [ceil(N/bn), ceil(K/bk)] (blocks, `weight_block_size` / `block_structure`, default 128 x 128);
* DeepSeek-V3: `weight` + `weight_scale_inv` [ceil(N/128), ceil(K/128)] (the name notwithstanding, a multiplier;
  the last row/column block may be partial); DeepSeek-V4 names it `scale` and may store it as E8M0.
`input_scale` (a static activation scale) is ignored: weight-only dequantisation.
"""

from __future__ import annotations

import torch

from .lowbit import e4m3_decode, e8m0_decode, expand_groups
from .quant_base import QuantFormat, describe, scalar_ok

_SCALES = ("weight_scale_inv", "weight_scale", "scale")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kind(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> str | None:
    if scalar_ok(scale):
        return "tensor"
    if tuple(scale.shape) in ((n, 1), (n,)):
        return "channel"
    if tuple(scale.shape) == (_cdiv(n, block[0]), _cdiv(k, block[1])):
        return "block"
    return None


class FP8Format(QuantFormat):
    name = "fp8"
    config_names = ("FP8", "FP8_BLOCK", "FP8_PER_CHANNEL_PER_TOKEN")
    description = ("FP8 E4M3 `weight` + fp32 `weight_scale` (scalar, [N,1] or 128x128 blocks) or DeepSeek's "
                   "`weight_scale_inv` [ceil(N/128), ceil(K/128)]")
    allowed = frozenset(("weight", "bias", "input_scale") + _SCALES)

    def problems(self, module, tensors, params):
        w = tensors.get("weight")
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float8_e4m3fn:
            return None
        out = self.stray(tensors)
        names = [s for s in _SCALES if s in tensors]
        if not names:
            return out + ["weight_scale (or DeepSeek's weight_scale_inv) is missing (expected fp32: a scalar, "
                          "[N, 1] or [ceil(N/128), ceil(K/128)])"]
        if len(names) > 1:
            return out + [f"both {' and '.join(names)} are present (expected one scale)"]
        if w.dim() != 2:
            return out + [f"weight is {describe(w)} (expected 2-D [N, K])"]
        s, (n, k), block = tensors[names[0]], w.shape, tuple(params.get("block_size") or (128, 128))
        if not isinstance(s, torch.Tensor) or s.dtype not in _SCALE_DTYPES:
            return out + [f"{names[0]} is {describe(s)} (expected fp32)"]
        if _kind(s, n, k, block) is None:
            return out + [f"{names[0]} has shape {list(s.shape)} (expected a scalar, [{n}, 1] or "
                          f"[{_cdiv(n, block[0])}, {_cdiv(k, block[1])}] ({block[0]}x{block[1]} blocks) for weight "
                          f"[{n}, {k}])"]
        return out

    def pack(self, module, tensors, params):
        w = tensors["weight"]
        name = next(s for s in _SCALES if s in tensors)
        s, (n, k) = tensors[name], w.shape
        block = tuple(params.get("block_size") or (128, 128))
        s = e8m0_decode(s) if s.dtype == torch.float8_e8m0fnu else s.float()
        cols = _cdiv(k, block[1])
        kind = _kind(tensors[name], n, k, block)
        if kind == "block":
            rows = s.repeat_interleave(block[0], dim=0)[:n]  # [N, ceil(K/bk)]
        else:
            rows = s.reshape(-1, 1).expand(n, cols) if kind == "channel" else s.reshape(1, 1).expand(n, cols)
        q = {"weight": w, "scale": rows.contiguous()}
        if "bias" in tensors:
            q["bias"] = tensors["bias"]
        return q, {"group": block[1]}

    def dequantize(self, q, meta):
        w = q["weight"]
        return e4m3_decode(w) * expand_groups(q["scale"], meta["group"], w.shape[1])
