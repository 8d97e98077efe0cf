"""NVFP4 (NVIDIA ModelOpt): `weight` U8 [N, K/2] (E2M1 codes, low nibble first), `weight_scale` float8_e4m3fn
[N, K/16] (one per 16 values along K; `group_size` from the config), `weight_scale_2` fp32 scalar, `input_scale`
fp32 scalar (the activations' scale: ignored by weight-only dequantisation). `w = e2m1 * weight_scale *
weight_scale_2` (e2m1 * e4m3 is exact in fp32, so the one rounding is the last product's).
"""

from __future__ import annotations

import torch

from .lowbit import e2m1_unpack, e4m3_decode, expand_groups
from .quant_base import QuantFormat, check, describe, scalar_ok


class NVFP4Format(QuantFormat):
    name = "nvfp4"
    config_names = ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ")
    description = ("NVFP4 `weight` U8 [N, K/2] + `weight_scale` F8_E4M3 [N, K/16] + `weight_scale_2` F32 scalar "
                   "(+ `input_scale`)")
    allowed = frozenset(("weight", "weight_scale", "weight_scale_2", "input_scale", "bias"))

    def problems(self, module, tensors, params):
        w = tensors.get("weight")
        if "weight_scale_2" not in tensors and not (
                isinstance(w, torch.Tensor) and w.dtype == torch.uint8 and "weight_scale" in tensors):
            return None
        group = int(params.get("group_size") or 16)
        out = self.stray(tensors) + check(tensors, "weight", (torch.uint8,), None, "uint8 [N, K/2]")
        if out:
            return out
        if w.dim() != 2:
            return [f"weight is {describe(w)} (expected uint8 [N, K/2])"]
        n, k = w.shape[0], w.shape[1] * 2
        if k % group:
            return [f"weight [N, K/2] = {list(w.shape)}: K = {k} is not a multiple of the group size {group}"]
        out = check(tensors, "weight_scale", (torch.float8_e4m3fn,), (n, k // group),
                    f"float8_e4m3fn, one per {group} of K = {k}")
        s2 = tensors.get("weight_scale_2")
        if s2 is None:
            out.append("weight_scale_2 is missing (expected a float32 scalar)")
        elif not scalar_ok(s2) or s2.dtype != torch.float32:
            out.append(f"weight_scale_2 is {describe(s2)} (expected a float32 scalar)")
        return out

    def pack(self, module, tensors, params):
        w = tensors["weight"]
        q = {"weight": w, "weight_scale": tensors["weight_scale"],
             "weight_scale_2": tensors["weight_scale_2"].float().reshape(1).expand(w.shape[0]).contiguous()}
        if "bias" in tensors:
            q["bias"] = tensors["bias"]
        return q, {"group": int(params.get("group_size") or 16)}

    def dequantize(self, q, meta):
        w = e2m1_unpack(q["weight"])
        scale = expand_groups(e4m3_decode(q["weight_scale"]), meta["group"], w.shape[1])
        return w * scale * q["weight_scale_2"][:, None]
