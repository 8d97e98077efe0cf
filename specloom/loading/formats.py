"""Weight formats: per module, which format the checkpoint holds, how it loads, and which kernel runs it.

The loader (`specloom.loading.weights.load_state_dict`) groups the checkpoint's tensors by module
(`layers.3.self_attn.q_proj` -> {"weight": ..., "bias": ...}, see `split_tensor_name`) and asks
`format_for(module, tensors, quant_config)` for the first registered format whose `matches` is true; a module
that no format matches fails with one `SpecloomError` naming the module, its tensors and the known formats. The
format's `load` returns the module's parameters (HF convention, as `dtype` on `device`). Once the model is built,
`apply_kernels(model, plan)` gives every `nn.Linear` the module its format's `kernel(linear, device)` chooses.

Registered formats:
* `dense` -- `weight` (+ `bias`) tensors in fp32 / bf16 / fp16 (HF safetensors or .bin). Kernel: for the target,
  the host's `KernelChoice` (`specloom.host.kernel_choice`: a measured probe picks among the kernels of
  models/cpu_packing.py that keep the model's numerics, cached per host); without one (drafters), oneDNN's
  pre-packed `PackedLinear` for bf16 on a CPU whose oneDNN supports bf16 and `nn.Linear` as is otherwise (fp32,
  fp16, and any non-CPU device: CUDA never gets oneDNN packing).
* `gguf` -- GGUF tensors of any GGML type the `gguf` package dequantizes (`specloom.loading.gguf_file`); they
  are dequantized at load, so the kernel is chosen as for `dense`.
* `fp8` (fp8.py) -- FP8 E4M3 with per-tensor / per-channel / 128x128 block scales (compressed-tensors'
  `weight_scale`, DeepSeek's `weight_scale_inv`); `mxfp4` (mxfp4.py) -- OCP MXFP4 `weight_blocks` +
  `weight_scales` (and DeepSeek-V4's int8 `weight` + E8M0 `scale`; gpt-oss fused experts via
  `mxfp4.dequantize_experts`); `nvfp4` (nvfp4.py) -- ModelOpt NVFP4 `weight` + `weight_scale` + `weight_scale_2`.
  They share quant_base.py: dequantised into the compute dtype at load (then run like `dense`), or, with
  `load_target(..., weights_resident="quantized")` / SPECLOOM_WEIGHTS_RESIDENT=quantized, held in their format
  as a `QuantLinear` that dequantises on each forward.

The format is decided per module, from its tensors (names, dtypes, shapes) and from what the checkpoint's
config declares for that module (quant_config.py: hf_quant_config.json and config.json's quantization_config,
exclude / ignore patterns, MIXED_PRECISION's quantized_layers): tensors in a quantized format the config does not
declare for the module, a declared format the tensors are not in, an unknown quant_algo, or tensors that nearly
fit a format (a scale missing, a shape off: the format's `problems` say which) each fail with one `SpecloomError`
naming the module, what was found and what was expected.

Adding a format (without touching the models: they build plain `nn.Linear`s):
1. write an object with `name`, `description`, `matches`, `load` and `kernel` (see `WeightFormat`; a quantized
   one subclasses `quant_base.QuantFormat` and writes `problems` / `pack` / `dequantize` and its `config_names`,
   the quant_algo names that declare it). `matches` must be false for any layout it cannot load.
2. `register_format(MyFormat(), before="dense")` -- formats are tried in order, so a narrower format goes first.
3. `load` returns the parameters its kernel needs, `kernel(linear, device)` the `nn.Module` that runs them
   (`forward(x)` like the `nn.Linear` it replaces; return `linear` itself to keep it).
Fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) concatenate each parameter along dim 0 (a held
`Quantized` concatenates its row-major tensors the same way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import SpecloomError
from ..models import cpu_packing
from ..models.cpu_packing import dense_kernel, replace_linears
from .fp8 import FP8Format
from .gguf_file import GGUFTensor, dequantize_gguf, gguf_blocks, gguf_dequantizable
from .mxfp4 import MXFP4Format
from .nvfp4 import NVFP4Format
from .quant_base import Quantized
from .quant_config import DENSE, as_quant_config

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
    """GGUF tensors: dequantized at load, or -- `weights_resident="quantized"`, the default for a GGUF target on
    a CPU where the kernel builds and runs faster -- held as shipped: a `GGMLLinear` / `GGMLEmbedding`
    (models/ggml_linear.py) computes from the blocks."""

    name = "gguf"
    dense = True
    description = "GGUF tensors of a GGML type the `gguf` package dequantizes (dequantized at load)"

    def matches(self, module: str, tensors: Tensors, quant_config: dict | None) -> bool:
        return (
            "weight" in tensors
            and set(tensors) <= set(_PARAM_NAMES)
            and all(isinstance(t, GGUFTensor) and gguf_dequantizable(t.type_name) for t in tensors.values())
        )

    def load(self, module, tensors, dtype, device="cpu", quant_config=None):
        return {k: dequantize_gguf(t).to(device=device, dtype=dtype) for k, t in tensors.items()}

    def kernel(self, linear, device):
        return dense_kernel(linear, device)  # dequantized: a dense weight

    # -- held as shipped ---------------------------------------------------------------------------------------

    def holds(self, tensors: Tensors) -> bool:
        """A weight of a GGML type the kernel runs, on a host where it builds."""
        from ..models import ggml_linear

        w = tensors.get("weight")
        return isinstance(w, GGUFTensor) and ggml_linear.has_kernel(w.type_name) and ggml_linear.available()

    def not_held(self, tensors: Tensors) -> str | None:
        """Why a quantized tensor is dequantised at load although blocks were asked for (None: it is held, or it
        is a plain F32/F16/BF16 tensor)."""
        from ..models import ggml_linear

        w = tensors.get("weight")
        if not isinstance(w, GGUFTensor) or w.type_name in ("F32", "F16", "BF16", "F64"):
            return None
        if not ggml_linear.has_kernel(w.type_name):
            return f"GGUF type {w.type_name} has no GGML block kernel (kernels: {', '.join(ggml_linear.KERNEL_TYPES)})"
        if not ggml_linear.available():
            return f"the GGML block kernel is unavailable ({ggml_linear.unavailable_reason()})"
        return None

    def load_quantized(self, module, tensors, dtype, device="cpu", quant_config=None) -> Quantized:
        from ..models.ggml_linear import KERNEL_TYPES

        blocks, k = gguf_blocks(tensors["weight"])
        return Quantized(self.name, {"blocks0": blocks},
                         {"types": [KERNEL_TYPES[tensors["weight"].type_name]], "in_features": k,
                          "rows": blocks.shape[0]}, self)

    def cat(self, parts: list[Quantized], name: str) -> Quantized:
        """Projections fused into one linear (q/k/v, gate/up): their blocks kept as segments (views of the file,
        not copied); the kernel module runs consecutive segments of one type as one weight."""
        if any(p.meta["in_features"] != parts[0].meta["in_features"] for p in parts):
            raise SpecloomError(f"malformed checkpoint: the parts of {name} have different input sizes")
        segs = [(p.q[f"blocks{i}"], t) for p in parts for i, t in enumerate(p.meta["types"])]
        return Quantized(self.name, {f"blocks{i}": w for i, (w, _) in enumerate(segs)},
                         {"types": [t for _, t in segs], "in_features": parts[0].meta["in_features"],
                          "rows": sum(w.shape[0] for w, _ in segs)}, self)

    def module(self, qz: Quantized, dtype: torch.dtype, bias: torch.Tensor | None = None) -> nn.Module:
        from ..models.ggml_linear import GGMLLinear

        parts = [(qz.q[f"blocks{i}"], t) for i, t in enumerate(qz.meta["types"])]
        return GGMLLinear(parts, qz.meta["in_features"], dtype, bias)

    def embedding(self, qz: Quantized, dtype: torch.dtype) -> nn.Module:
        from ..models.ggml_linear import GGMLEmbedding

        if len(qz.meta["types"]) != 1:
            raise SpecloomError("malformed checkpoint: an embedding stored in several GGML types")
        return GGMLEmbedding(qz.q["blocks0"], qz.meta["types"][0], qz.meta["in_features"], dtype)


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
for _fmt in (FP8Format(), MXFP4Format(), NVFP4Format()):  # narrower than dense: tried first
    register_format(_fmt, before="dense")


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


def _algo_formats() -> dict[str, WeightFormat]:
    return {n.upper(): f for f in FORMATS.values() for n in getattr(f, "config_names", ())}


def _expected(fmt: WeightFormat | None) -> str:
    return f"{fmt.name}: {fmt.description}" if fmt is not None else "dense fp32/bf16/fp16 `weight` (+ `bias`)"


def _check_declared(module: str, fmt: WeightFormat, found: str, declared, qc) -> None:
    """The format the tensors are in against what the config declares for this module: one error if they differ."""
    algo = declared.algo if declared is not None else None
    by_algo = _algo_formats()
    if algo not in (None, DENSE) and algo not in by_algo:
        raise SpecloomError(f"module {module!r}: {declared.where}, an unknown quant_algo {algo!r} (known: "
                            f"{', '.join(sorted(by_algo))})")
    want = by_algo.get(algo)
    if getattr(fmt, "quantized", False):
        if qc is None:
            raise SpecloomError(
                f"module {module!r}: its tensors [{found}] are {fmt.name} but the checkpoint's config declares no "
                "quantization (no quantization_config in config.json, no hf_quant_config.json); expected "
                f"{_expected(None)}, or a config that declares {fmt.name}")
        if want is not fmt:
            said = declared.where if declared is not None else "the config declares nothing for it"
            raise SpecloomError(f"module {module!r}: {said}, so expected {_expected(want)}; found {fmt.name} "
                                f"tensors [{found}]")
    elif want is not None and declared.explicit:
        raise SpecloomError(f"module {module!r}: {declared.where}, so expected {_expected(want)}; found "
                            f"{fmt.name} tensors [{found}]")


def format_for(module: str, tensors: Tensors, quant_config=None, checkpoint_name: str | None = None) -> WeightFormat:
    """The first registered format that reads this module's tensors, checked against what `quant_config` (a
    `QuantConfig` or HF's `quantization_config` dict) declares for the module (`checkpoint_name`: its name as the
    checkpoint spells it, default `module`); one `SpecloomError` when none reads them or they disagree."""
    qc = as_quant_config(quant_config)
    declared = qc.declared(checkpoint_name or module) if qc is not None else None
    found = ", ".join(f"{k}: {_describe(t)}" for k, t in sorted(tensors.items()))
    for fmt in FORMATS.values():
        if fmt.matches(checkpoint_name or module, tensors, qc):
            _check_declared(module, fmt, found, declared, qc)
            return fmt
    quant = ""
    if qc is not None and qc.get("quant_method") is not None:
        quant = f" (the config's quantization_config has quant_method {qc.get('quant_method')!r})"
    if declared is not None and declared.algo != DENSE:
        quant += f" ({declared.where})"
    params = dict(declared.params) if declared is not None else {}
    near = [f"{f.name}: {'; '.join(p)}" for f in FORMATS.values()
            if hasattr(f, "problems") and (p := f.problems(module, tensors, params))]
    near_s = f"; as {' / '.join(near)}" if near else ""
    known = "; ".join(f"{f.name}: {f.description}" for f in FORMATS.values())
    raise SpecloomError(
        f"module {module!r}: no weight format reads its tensors [{found}]{quant}{near_s}; known formats: {known}"
    )


def apply_kernels(model: nn.Module, plan: Mapping[str, str] | None = None,
                  device: torch.device | str | None = None, choice=None) -> int:
    """Replace every plain `nn.Linear` of `model` by the kernel its weight format chooses. `plan` maps a module
    name (as in `model.named_modules()`) to the format its weights came from; a linear it does not name is
    `dense`. `device` is where the model will run (default: where each weight is). `choice`: the host's
    `KernelChoice` for formats that load dense weights (`fmt.dense`). Returns how many were replaced."""
    plan = plan or {}

    def kernel(full: str, child: nn.Linear) -> nn.Module:
        fmt_name = plan.get(full, "dense")
        if fmt_name not in FORMATS:
            raise SpecloomError(f"module {full!r}: unknown weight format {fmt_name!r} ({', '.join(FORMATS)})")
        fmt, dev = FORMATS[fmt_name], child.weight.device if device is None else device
        if choice is not None and getattr(fmt, "dense", False):
            return dense_kernel(child, dev, choice)
        return fmt.kernel(child, dev)

    return replace_linears(model, kernel)
