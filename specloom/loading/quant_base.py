"""What the quantized weight formats (fp8.py, mxfp4.py, nvfp4.py) share.

A `QuantFormat` reads one module's tensors in three steps:
* `problems(module, tensors, params)` -- None when the tensors are not this format's at all (its signature
  tensor/dtype is absent), [] when they are and fit, else what is wrong (a scale missing, a shape off). `matches`
  is `problems == []`; the registry shows the problems of a near miss.
* `pack(module, tensors, params)` -> (`q`, `meta`): the module held quantized, every tensor row-major with the
  output dimension first (so fused q/k/v and gate/up concatenate along dim 0), `meta` the group sizes.
* `dequantize(q, meta)` -> the fp32 [N, K] weight, exactly.

`load` dequantises at load (the default: the dense kernels then run it); with `weights_resident="quantized"`
the loader keeps `Quantized(fmt, q, meta)` instead and `build_model` puts a `QuantLinear` in the linear's place,
which dequantises into the compute dtype on each forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

Params = dict  # what the config says for this module: block_size, group_size


def describe(t) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def is_tensor(tensors, name: str, *dtypes) -> bool:
    t = tensors.get(name)
    return isinstance(t, torch.Tensor) and (not dtypes or t.dtype in dtypes)


def check(tensors, name: str, dtypes: tuple, shape: tuple | None, what: str) -> list[str]:
    """[] when `tensors[name]` exists with one of `dtypes` and `shape` (None: any), else what is wrong."""
    if name not in tensors:
        return [f"{name} is missing (expected {what})"]
    t = tensors[name]
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        return [f"{name} is {describe(t)} (expected {what})"]
    if shape is not None and tuple(t.shape) != tuple(shape):
        return [f"{name} has shape {list(t.shape)} (expected {list(shape)}: {what})"]
    return []


def scalar_ok(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1 and t.dim() <= 1


class QuantFormat:
    dense = True  # dequantised at load: the host's dense kernel choice runs it
    quantized = True  # holds a quantized layout (the config must declare it)
    config_names: tuple[str, ...] = ()  # quant_algo names that declare this format
    allowed: frozenset[str] = frozenset()  # every short tensor name it reads or ignores

    def problems(self, module: str, tensors, params: Params) -> list[str] | None:
        raise NotImplementedError

    def pack(self, module: str, tensors, params: Params) -> tuple[dict, dict]:
        raise NotImplementedError

    def dequantize(self, q: dict, meta: dict) -> torch.Tensor:
        raise NotImplementedError

    def stray(self, tensors, allowed: frozenset[str] | None = None) -> list[str]:
        allowed = self.allowed if allowed is None else allowed
        return [f"{k} is not a tensor this format reads" for k in sorted(set(tensors) - allowed)]

    def matches(self, module, tensors, quant_config=None) -> bool:
        return self.problems(module, tensors, params_for(quant_config, module)) == []

    def holds(self, tensors) -> bool:
        """Whether a linear of these tensors can be held in this format (`weights_resident="quantized"`)."""
        return True

    def load(self, module, tensors, dtype, device="cpu", quant_config=None) -> dict[str, torch.Tensor]:
        q, meta = self.pack(module, tensors, params_for(quant_config, module))
        out = {"weight": self.dequantize(q, meta).to(device=device, dtype=dtype)}
        if "bias" in q:
            out["bias"] = q["bias"].to(device=device, dtype=dtype)
        return out

    def load_quantized(self, module, tensors, dtype, device="cpu", quant_config=None) -> Quantized:
        q, meta = self.pack(module, tensors, params_for(quant_config, module))
        q.pop("bias", None)  # loaded dense, next to it
        k = int(self.dequantize({n: v[:1] for n, v in q.items()}, meta).shape[1])  # one row: its K
        return Quantized(self.name, {n: v.to(device) for n, v in q.items()}, {**meta, "in_features": k}, self)

    def kernel(self, linear, device):
        from ..models.cpu_packing import dense_kernel

        return dense_kernel(linear, device)  # dequantised at load: a dense weight


def params_for(quant_config, module: str) -> Params:
    from .quant_config import as_quant_config

    qc = as_quant_config(quant_config)
    d = qc.declared(module) if qc is not None else None
    return dict(d.params) if d is not None else {}


@dataclass
class Quantized:
    """One module held in its checkpoint's format (see the module docstring)."""
    fmt: str
    q: dict
    meta: dict
    format: object = field(default=None, compare=False, repr=False)  # the QuantFormat that packed it

    @staticmethod
    def cat(parts: list[Quantized], name: str) -> Quantized:
        from ..errors import SpecloomError

        if len(parts) == 1:
            return parts[0]
        if hasattr(parts[0].format, "cat"):  # a format whose parts may differ (GGUF: a type per projection)
            return parts[0].format.cat(parts, name)
        if any(p.meta != parts[0].meta or set(p.q) != set(parts[0].q) for p in parts):
            raise SpecloomError(f"malformed checkpoint: the parts of {name} are quantized with different group "
                                f"sizes or tensors ({[p.meta for p in parts]}) but run as one linear")
        return Quantized(parts[0].fmt, {k: torch.cat([p.q[k] for p in parts]) for k in parts[0].q}, parts[0].meta,
                         parts[0].format)

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.meta.get("rows") or next(iter(self.q.values())).shape[0]
        return int(rows), int(self.meta["in_features"])

    def module(self, dtype: torch.dtype, bias: torch.Tensor | None = None) -> nn.Module:
        """The module that runs it: the format's own kernel (`format.module`), else a `QuantLinear`."""
        if hasattr(self.format, "module"):
            return self.format.module(self, dtype, bias)
        return QuantLinear(self, dtype, bias)


class QuantLinear(nn.Module):
    """An `nn.Linear` stand-in that holds its weight quantized and dequantises it on each forward."""

    def __init__(self, qz: Quantized, dtype: torch.dtype, bias: torch.Tensor | None = None):
        super().__init__()
        if qz.format is None:
            raise ValueError(f"{qz.fmt} weights without their format object (QuantFormat.load_quantized sets it)")
        self.fmt, self.meta, self.dtype = qz.format, dict(qz.meta), dtype
        self.names = list(qz.q)
        for k in self.names:
            self.register_buffer(f"q_{k}", qz.q[k])
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = qz.shape

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (made on each call: what `forward` multiplies by)."""
        return self.fmt.dequantize({k: getattr(self, f"q_{k}") for k in self.names}, self.meta).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, out_features={self.out_features}, {self.meta}"
