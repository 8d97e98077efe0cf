"""Round-to-nearest quantization of one fp32 [N, K] weight into a registered weight format, in the tensor layout
its producers write (the loaders are loading/fp8.py, mxfp4.py, nvfp4.py); each writer also returns its own
reference dequantisation (what a reader must get back, bit for bit).

* `fp8` -- DeepSeek-V3 blocks: `weight` float8_e4m3fn [N, K] + `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]
  (a multiplier: w = e4m3 * scale); per 128 x 128 block scale = absmax / 448, codes = RNE(w / scale) (saturated).
* `mxfp4` -- OCP MX: `weight_blocks` uint8 [N, K/32, 16] (E2M1 codes two per byte, low nibble first) +
  `weight_scales` uint8 [N, K/32] (E8M0); per 32 values the scale is 2^(floor(log2 absmax) - 2) (E2M1's largest
  power of two is 2^2), codes = RNE(w / scale) saturated at +-6.
* `nvfp4` -- NVIDIA ModelOpt: `weight` uint8 [N, K/2] + `weight_scale` float8_e4m3fn [N, K/16] + `weight_scale_2`
  fp32 scalar (absmax(W) / (6 * 448)) + `input_scale` fp32 scalar; per 16 values block scale = E4M3(absmax / 6 /
  weight_scale_2) (a zero block gets 1), codes = RNE(w / (block scale * weight_scale_2)); w = e2m1 * block
  scale * weight_scale_2 (the product in that order: e2m1 * e4m3 is exact in fp32). No activations are seen, so
  `input_scale` is 1.0 (weight-only readers, specloom's included, ignore it).

E2M1 rounding is to nearest, ties to the even code (the one whose mantissa bit is 0).
"""

from __future__ import annotations

import torch

from ..errors import SpecloomError

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDS = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
E4M3_MAX = 448.0


def e2m1_round(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (already scaled) -> (E2M1 codes 0..15 as uint8, the fp32 values they stand for); magnitudes
    above 6 saturate to 6, ties go to the even code, a value that rounds to 0 keeps code 0 (+0)."""
    a = x.abs().clamp(max=6.0)
    code = torch.bucketize(a, _MIDS)  # how many midpoints lie strictly below a: ties round down here
    at_mid = (code < 7) & (a == _MIDS[code.clamp(max=6)])
    code = code + (at_mid & (code % 2 == 1)).long()  # a tie whose lower neighbour is odd goes up (to even)
    value = E2M1_GRID[code]
    negative = (x < 0) & (code > 0)
    return (code + 8 * negative.long()).to(torch.uint8), torch.where(negative, -value, value)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2M] codes -> [..., M] bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RTNWriter:
    """One format's writer: `quantize(w)` -> ({short tensor name: tensor}, reference fp32 dequantisation)."""
    name = ""
    algo = ""  # the quant_algo name that declares it (ModelOpt / MIXED_PRECISION spelling)
    group = 1  # K must be a multiple of this

    def fits(self, shape) -> bool:
        return len(shape) == 2 and shape[1] % self.group == 0

    def quantize(self, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def config(self, exclude: list[str]) -> tuple[dict, dict | None]:
        """(config.json's quantization_config, hf_quant_config.json or None) declaring this format for every
        module but `exclude`."""
        raise NotImplementedError


class FP8BlockWriter(RTNWriter):
    name, algo, group, block = "fp8", "FP8", 1, 128

    def quantize(self, w):
        n, k = w.shape
        b = self.block
        pad = torch.zeros(_cdiv(n, b) * b, _cdiv(k, b) * b)
        pad[:n, :k] = w.abs()
        amax = pad.reshape(_cdiv(n, b), b, _cdiv(k, b), b).amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        full = scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
        q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale.contiguous()}, q.float() * full

    def config(self, exclude):
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [self.block, self.block], "modules_to_not_convert": exclude}, None


class MXFP4Writer(RTNWriter):
    name, algo, group = "mxfp4", "MXFP4", 32

    def quantize(self, w):
        n, k = w.shape
        blocks = w.reshape(n, k // 32, 32)
        _, exp = torch.frexp(blocks.abs().amax(-1))  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
        byte = (exp - 1 - 2 + 127).clamp(0, 254)
        scale = torch.ldexp(torch.ones(byte.shape), byte - 127)
        codes, vals = e2m1_round(blocks / scale[..., None])
        packed = pack_nibbles(codes).reshape(n, k // 32, 16)
        return ({"weight_blocks": packed.contiguous(), "weight_scales": byte.to(torch.uint8).contiguous()},
                (vals * scale[..., None]).reshape(n, k))

    def config(self, exclude):
        return {"quant_method": "mxfp4", "modules_to_not_convert": exclude}, None


class NVFP4Writer(RTNWriter):
    name, algo, group = "nvfp4", "NVFP4", 16

    def quantize(self, w):
        n, k = w.shape
        amax = w.abs().max()
        s2 = (amax / (6.0 * E4M3_MAX)) if amax > 0 else torch.tensor(1.0)
        s2 = s2.float().reshape(())
        blocks = w.reshape(n, k // 16, 16)
        bsf = (blocks.abs().amax(-1) / 6.0 / s2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        bsf = torch.where(bsf > 0, bsf, torch.ones_like(bsf))  # a block that is (or rounds to) zero: scale 1
        bs = bsf.to(torch.float8_e4m3fn)  # exact: every value is an E4M3 value
        codes, vals = e2m1_round(blocks / (bsf * s2)[..., None])
        ref = (vals * bsf[..., None]).reshape(n, k) * s2
        return {"weight": pack_nibbles(codes.reshape(n, k)).contiguous(), "weight_scale": bs.contiguous(),
                "weight_scale_2": s2.clone(), "input_scale": torch.tensor(1.0)}, ref

    def config(self, exclude):
        q = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": self.group, "exclude_modules": exclude}
        return {"quant_method": "modelopt", **q, "producer": producer()}, {"producer": producer(), "quantization": q}


def producer() -> dict:
    from .. import __version__

    return {"name": "specloom", "version": __version__}


WRITERS: dict[str, RTNWriter] = {w.name: w for w in (FP8BlockWriter(), MXFP4Writer(), NVFP4Writer())}
DENSE = "dense"  # the drafter format that keeps the drafter's linears unquantized
_DENSE_NAMES = ("dense", "bf16", "none")


def writer_for(name: str | None, what: str = "--format") -> RTNWriter | None:
    """The writer of format `name` (None for dense, where allowed), or one line naming the known ones."""
    if name is None:
        return None
    key = str(name).lower()
    if key in WRITERS:
        return WRITERS[key]
    if what != "--format" and key in _DENSE_NAMES:
        return None
    extra = " or bf16 (left dense)" if what != "--format" else ""
    raise SpecloomError(f"{what}: unknown format {name!r} (choose {', '.join(WRITERS)}{extra})")


def mixed_config(layers: dict[str, RTNWriter], exclude: list[str]) -> tuple[dict, dict]:
    """ModelOpt MIXED_PRECISION: every quantized module named with its own quant_algo, every other one dense."""
    ql = {m: {"quant_algo": w.algo, **({"group_size": w.group} if w.name == "nvfp4" else {})}
          for m, w in sorted(layers.items())}
    q = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": exclude,
         "quantized_layers": ql}
    return {"quant_method": "modelopt", **q, "producer": producer()}, {"producer": producer(), "quantization": q}


def check_finite(module: str, w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        raise SpecloomError(f"module {module!r}: its weight holds inf or NaN values; cannot quantize it")
