"""The element and scale number formats that quantized checkpoints store, decoded exactly (into fp32).

* FP4 E2M1 (`s e1 e0 m`, no inf/NaN): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are the negatives. Packed
  two per byte, the LOW nibble holding the first (even) element -- MXFP4 and NVFP4 alike.
* E8M0 (OCP MX block scale): a byte `b` is 2^(b - 127); 255 is NaN.
* FP8 E4M3 (`float8_e4m3fn`: bias 7, no inf, 0x7f/0xff NaN, max 448): decoded by PyTorch's own dtype.

Every product formed below is exact in fp32 before its one rounding (E2M1 has 2 significant bits, E4M3 4), so a
dequantised weight is the correctly rounded value of its decimal definition.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a one-byte tensor (uint8, int8, float8_*) as uint8, same shape."""
    if t.element_size() != 1:
        raise ValueError(f"expected a one-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., M] bytes (two E2M1 codes each, low nibble first) -> [..., 2M] fp32 values."""
    b = as_bytes(packed).long()
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    return _E2M1[codes]


def e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(b-127) (255 -> NaN). 2^-127 is an fp32 subnormal: exact."""
    b = as_bytes(scales).to(torch.int32)
    out = torch.ldexp(torch.ones(b.shape, dtype=torch.float32), b - 127)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def e4m3_decode(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its raw bytes) -> fp32."""
    return as_bytes(t).view(torch.float8_e4m3fn).float()


def expand_groups(scale: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[..., ceil(K/group)] per-group scales -> [..., K] (the last group may be partial)."""
    return scale.repeat_interleave(group, dim=-1)[..., :k]
