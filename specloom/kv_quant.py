"""KV cache types (`--kv-cache-dtype`, and `kv_cache_dtype` in `--speculative-config` for a drafter's own KV).

    t = parse_kv_cache_dtype("int8")      # a KVType; "auto" / None -> None (the model's default: fp32 on CPU)
    codes, scale = t.quantize(x)          # x (..., d) -> codes (..., d) in t.storage, scale (...,) fp32
    x_hat = t.dequantize(codes, scale)    # (..., d) fp32

Plain types (fp32, bf16, fp16) store keys/values as they are. Quantized types (fp8_e4m3, fp8_e5m2, int8) store
one code per element and one fp32 scale per token and head: scale = absmax(vector) / qmax, codes = x / scale
rounded to the type's grid (int8: round half to even, clamped to +-127; fp8: PyTorch's round-to-nearest-even
cast after clamping to +-qmax, so nothing overflows to NaN). A vector of zeros gets scale 0 and codes 0. fp8
codes are held as their bit pattern in uint8 (PyTorch's CPU kernels copy and gather uint8, not float8) and
viewed back as float8 to decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpecloomError

SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVType:
    name: str  # the option's spelling
    dtype: torch.dtype  # plain: the stored dtype; quantized: the number type of a code
    qmax: float | None = None  # quantized: the largest code magnitude

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    @property
    def storage(self) -> torch.dtype:
        """The dtype of the tensor that holds the codes (fp8: its bit pattern as uint8)."""
        if self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return torch.uint8
        return self.dtype

    @property
    def label(self) -> str:
        """How reports name it: the torch dtype's name for a plain type ("float32"), else the option's name."""
        return self.name if self.quantized else str(self.dtype).replace("torch.", "")

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes of one token's key (or value) for one head, its scale included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return head_dim * elem + (torch.empty((), dtype=SCALE_DTYPE).element_size() if self.quantized else 0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., d) -> (codes (..., d) in `storage`, scale (...,) fp32), one scale per vector of the last dim."""
        x = x.float()
        scale = x.abs().amax(-1) / self.qmax
        y = x / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        y = y.clamp(-self.qmax, self.qmax)
        if self.dtype == torch.int8:
            codes = y.round().to(torch.int8)
        else:
            codes = y.to(self.dtype).view(torch.uint8)
        return codes, scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes (..., d), scale (...,) -> values (..., d) in `dtype`."""
        vals = codes.view(self.dtype) if self.storage != self.dtype else codes
        return (vals.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


KV_TYPES: dict[str, KVType] = {t.name: t for t in (
    KVType("fp32", torch.float32),
    KVType("bf16", torch.bfloat16),
    KVType("fp16", torch.float16),
    KVType("fp8_e4m3", torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max),  # 448
    KVType("fp8_e5m2", torch.float8_e5m2, torch.finfo(torch.float8_e5m2).max),  # 57344
    KVType("int8", torch.int8, 127.0),
)}
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8": "fp8_e4m3",
           "fp8_e4m3fn": "fp8_e4m3"}
CHOICES = ("auto", *KV_TYPES)
_BY_DTYPE = {t.dtype: t for t in KV_TYPES.values()}


def kv_type(value) -> KVType:
    """A KVType from a KVType, a torch dtype or a name (no "auto")."""
    if isinstance(value, KVType):
        return value
    if isinstance(value, torch.dtype):
        if value in _BY_DTYPE:
            return _BY_DTYPE[value]
        if value.is_floating_point and value.itemsize > 1:  # another plain dtype (fp64, in tests): stored as is
            return KVType(str(value).replace("torch.", ""), value)
        raise SpecloomError(f"a KV cache cannot hold {value}: choose from {', '.join(KV_TYPES)}")
    t = parse_kv_cache_dtype(value)
    if t is None:
        raise SpecloomError("a KV store needs a concrete type, not 'auto'")
    return t


def parse_kv_cache_dtype(value, what: str = "--kv-cache-dtype") -> KVType | None:
    """`auto` / None -> None (the model's default); a name, alias, torch dtype or KVType -> its KVType; anything
    else one SpecloomError naming the choices."""
    if value is None or isinstance(value, KVType):
        return value
    if isinstance(value, torch.dtype):
        return kv_type(value)
    if isinstance(value, str):
        name = value.strip().lower()
        if name == "auto":
            return None
        name = ALIASES.get(name, name)
        if name in KV_TYPES:
            return KV_TYPES[name]
    raise SpecloomError(f"{what} must be one of {', '.join(CHOICES)}, got {value!r}")


def kv_dtype_arg(value, what: str = "--kv-cache-dtype"):
    """What the engine, the scheduler and `new_kv` take: None (auto), a torch dtype for a plain type (as before
    quantized types existed) or the KVType of a quantized one."""
    t = parse_kv_cache_dtype(value, what)
    return t if t is None or t.quantized else t.dtype
