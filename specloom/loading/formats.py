"""Weight formats: per module, which format the checkpoint holds, how it loads, and which kernel runs it.

The loader (`specloom.loading.weights.load_state_dict`) groups the checkpoint's tensors by module
(`layers.3.self_attn.q_proj` -> {"weight": ..., "bias": ...}, see `split_tensor_name`) and asks
`format_for(module, tensors, quant_config)` for the first registered format whose `matches` is true; a module
that no format matches fails with one `SpecloomError` naming the module, its tensors and the known formats. The
format's `load` returns the module's parameters (HF convention, as `dtype` on `device`). Once the model is built,
`apply_kernels(model, plan)` gives every `nn.Linear` the module its format's `kernel(linear, device)` chooses.

Registered formats:
* `dense` -- `weight` (+ `bias`) tensors in fp32 / bf16 / fp16 (HF safetensors or .bin). Kernel: for the target,
  the host's `KernelChoice` (`specloom.bench.kernel_probe`: a measured probe picks among the kernels of
  models/cpu_packing.py that keep the model's numerics, cached per host); without one (drafters), oneDNN's
  pre-packed `PackedLinear` for bf16 on a CPU whose oneDNN supports bf16 and `nn.Linear` as is otherwise (fp32,
  fp16, and any non-CPU device: CUDA never gets oneDNN packing).
* `gguf` -- GGUF tensors of any GGML type the `gguf` package dequantizes (`specloom.loading.gguf_file`); they
  are dequantized at load, so the kernel is chosen as for `dense`.

Adding a format (FP8, MXFP4, NVFP4, ...), without touching the models (they build plain `nn.Linear`s):
1. write an object with `name`, `description`, `matches`, `load` and `kernel` (see `WeightFormat`). `matches`
   reads the tensor names/dtypes (e.g. `weight` float8_e4m3fn + `weight_scale_inv`) and/or `quant_config` (HF's
   `quantization_config`, e.g. `quant_method == "fp8"`); it must be false for any layout it cannot load.
2. `register_format(MyFormat(), before="dense")` -- formats are tried in order, so a narrower format goes first.
3. `load` returns the parameters its kernel needs, `kernel(linear, device)` the `nn.Module` that runs them
   (`forward(x)` like the `nn.Linear` it replaces; return `linear` itself to keep it).
What a non-dense parameter set still needs from the loader (today every format loads to a dense `weight`/`bias`):
fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) concatenate each parameter along dim 0, and
`build_model` accepts only the parameter names of the model's modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import SpecloomError
from ..models import cpu_packing
from .gguf_file import GGUFTensor, dequantize_gguf, gguf_dequantizable

# A module's tensors under their short names ("weight", "bias", "weight_scale_inv", ...): torch tensors for
# HF checkpoints, `GGUFTensor`s for GGUF files; a format decides what it accepts.
Tensors = Mapping[str, Any]

_PARAM_NAMES = ("weight", "bias")


@runtime_checkable
class WeightFormat(Protocol):
    name: str
    description: str  # one line: what tensors it reads (shown when nothing matches)

    def matches(self, module: str, tensors: Tensors, quant_config: dict | None) -> bool: ...

    def load(self, module: str, tensors: Tensors, dtype: torch.dtype,
             device: torch.device | str) -> dict[str, torch.Tensor]: ...

    def kernel(self, linear: nn.Linear, device: torch.device | str) -> nn.Module: ...


def dense_kernel(linear: nn.Linear, device: torch.device | str | None = None, choice=None) -> nn.Module:
    """The kernel for a dense `nn.Linear` that runs on `device` (default: where its weight is). With a `choice`
    (a `KernelChoice`: `single` and `multi` kernel names) its kernels, one module or a `RowSplitLinear`; without
    one the oneDNN pre-packed bf16 layout on a CPU that supports it (bit-identical to `F.linear` per product,
    faster when decoding), the plain `nn.Linear` everywhere else."""
    device = linear.weight.device if device is None else torch.device(device)
    if choice is not None and device.type == "cpu":
        single = cpu_packing.build_kernel(choice.single, linear)
        if choice.multi == choice.single:
            return single
        return cpu_packing.RowSplitLinear(linear, single, cpu_packing.build_kernel(choice.multi, linear))
    if cpu_packing.packing_supported(linear.weight.dtype, device):
        return cpu_packing.PackedLinear(linear)
    return linear


class DenseFormat:
    name = "dense"
    dense = True  # loads to a dense `weight`: the host's kernel choice applies
    description = "fp32/bf16/fp16 `weight` (+ `bias`) tensors"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def matches(self, module: str, tensors: Tensors, quant_config: dict | None) -> bool:
        return (
            "weight" in tensors
            and set(tensors) <= set(_PARAM_NAMES)
            and all(isinstance(t, torch.Tensor) and t.dtype in self.dtypes for t in tensors.values())
        )

    def load(self, module, tensors, dtype, device="cpu"):
        return {k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}

    def kernel(self, linear, device):
        return dense_kernel(linear, device)


class GGUFFormat:
    name = "gguf"
    dense = True
    description = "GGUF tensors of a GGML type the `gguf` package dequantizes (dequantized at load)"

    def matches(self, module: str, tensors: Tensors, quant_config: dict | None) -> bool:
        return (
            "weight" in tensors
            and set(tensors) <= set(_PARAM_NAMES)
            and all(isinstance(t, GGUFTensor) and gguf_dequantizable(t.type_name) for t in tensors.values())
        )

    def load(self, module, tensors, dtype, device="cpu"):
        return {k: dequantize_gguf(t).to(device=device, dtype=dtype) for k, t in tensors.items()}

    def kernel(self, linear, device):
        return dense_kernel(linear, device)  # dequantized: a dense weight


FORMATS: dict[str, WeightFormat] = {}


def register_format(fmt: WeightFormat, before: str | None = None) -> WeightFormat:
    """Add `fmt` to the registry (tried in order; `before` puts it ahead of that format)."""
    if not isinstance(fmt, WeightFormat):
        raise TypeError(f"{fmt!r} lacks part of the WeightFormat protocol (name, description, matches, load, kernel)")
    items = [(k, v) for k, v in FORMATS.items() if k != fmt.name]
    at = next((i for i, (k, _) in enumerate(items) if k == before), len(items))
    items.insert(at, (fmt.name, fmt))
    FORMATS.clear()
    FORMATS.update(items)
    return fmt


register_format(DenseFormat())
register_format(GGUFFormat())


def format_names() -> list[str]:
    return list(FORMATS)


def split_tensor_name(name: str) -> tuple[str, str]:
    """`layers.0.mlp.up_proj.weight` -> (`layers.0.mlp.up_proj`, `weight`). Names with more after a `weight`
    or `bias` component (bitsandbytes' `weight.absmax`) keep it in the short name."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if i and p in _PARAM_NAMES:
            return ".".join(parts[:i]), ".".join(parts[i:])
    if len(parts) == 1:
        return "", name
    return ".".join(parts[:-1]), parts[-1]


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    if isinstance(t, GGUFTensor):
        return f"GGUF {t.type_name}"
    dtype = getattr(t, "dtype", None)
    return f"{type(t).__name__}" + (f" {dtype}" if dtype is not None else "")


def format_for(module: str, tensors: Tensors, quant_config: dict | None = None) -> WeightFormat:
    """The first registered format that reads this module's tensors; a `SpecloomError` when none does."""
    for fmt in FORMATS.values():
        if fmt.matches(module, tensors, quant_config):
            return fmt
    found = ", ".join(f"{k}: {_describe(t)}" for k, t in sorted(tensors.items()))
    quant = ""
    if quant_config:
        quant = f" (the config's quantization_config has quant_method {quant_config.get('quant_method')!r})"
    known = "; ".join(f"{f.name}: {f.description}" for f in FORMATS.values())
    raise SpecloomError(
        f"module {module!r}: no weight format reads its tensors [{found}]{quant}; known formats: {known}"
    )


def apply_kernels(model: nn.Module, plan: Mapping[str, str] | None = None,
                  device: torch.device | str | None = None, choice=None) -> int:
    """Replace every plain `nn.Linear` of `model` by the kernel its weight format chooses. `plan` maps a module
    name (as in `model.named_modules()`) to the format its weights came from; a linear it does not name is
    `dense`. `device` is where the model will run (default: where each weight is). `choice`: the host's
    `KernelChoice` for formats that load dense weights (`fmt.dense`). Returns how many were replaced."""
    plan = plan or {}
    count = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            full = f"{prefix}.{name}" if prefix else name
            fmt_name = plan.get(full, "dense")
            if fmt_name not in FORMATS:
                raise SpecloomError(f"module {full!r}: unknown weight format {fmt_name!r} ({', '.join(FORMATS)})")
            fmt, dev = FORMATS[fmt_name], child.weight.device if device is None else device
            if choice is not None and getattr(fmt, "dense", False):
                new = dense_kernel(child, dev, choice)
            else:
                new = fmt.kernel(child, dev)
            if new is not child:
                setattr(parent, name, new)
                count += 1
    return count
