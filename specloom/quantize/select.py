"""Which modules of a checkpoint get quantized, and in which format.

A module is quantized when it is a linear projection of a decoder block or of a drafter layer -- its last name
component one of `LINEARS` (attention q/k/v/o, the gated MLP and MoE experts, Mixtral's w1..w3, MTP's `eh_proj`,
DSpark's `main_proj`, EAGLE / DFlash's `fc`) with a 2-D floating `weight` -- and no `--exclude` pattern matches
it. Embeddings, norms, heads (`lm_head`, Markov and confidence heads), MoE routers and biases stay dense. A linear
whose input width is not a multiple of the format's group stays dense too (one warning names them). Patterns are
matched as the loaders match them (loading/quant_config.pattern_matches: glob or `re:`, with and without the
`model.` prefix, parents included).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ..loading.formats import split_tensor_name
from ..loading.quant_config import pattern_matches
from .rtn import RTNWriter, check_finite

LINEARS = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
                     "eh_proj", "main_proj", "fc"))
HEADS = ("lm_head",)  # linears kept dense and named in the exclude list, as ModelOpt does


def warn(msg: str) -> None:
    print(f"specloom: warning: {msg}", file=sys.stderr, flush=True)


def linear_module(name: str, t) -> str | None:
    """The module of a quantizable linear's `weight` tensor, else None."""
    module, key = split_tensor_name(name)
    if key != "weight" or not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
        return None
    return module if module.rpartition(".")[2] in LINEARS else None


def head_modules(tensors) -> list[str]:
    return sorted({m for n in tensors for m, k in [split_tensor_name(n)] if k == "weight" and m in HEADS})


@dataclass
class Written:
    """What a quantization pass wrote: HF-named tensors, the format of each quantized module, the writer's own
    reference dequantisation of each (fp32 [N, K]; kept when asked), and the linears left dense."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    formats: dict[str, RTNWriter] = field(default_factory=dict)
    refs: dict[str, torch.Tensor] = field(default_factory=dict)
    unfit: list[str] = field(default_factory=list)


def quantize_tensors(tensors: dict[str, torch.Tensor], writer: RTNWriter | None, exclude: list[str],
                     dense_dtype: torch.dtype, out: Written, keep_refs: bool = False) -> Written:
    """Quantize every selected linear of `tensors` with `writer` (None: all dense) into `out`; every other
    floating tensor is written as `dense_dtype`, integer tensors (EAGLE-3's d2t, t2d) as they are."""
    for name, t in tensors.items():
        module = linear_module(name, t) if writer is not None else None
        if module is not None and any(pattern_matches(p, module) for p in exclude):
            module = None
        if module is not None and not writer.fits(t.shape):
            out.unfit.append(module)
            module = None
        if module is None:
            out.tensors[name] = t.to(dense_dtype).contiguous() if t.is_floating_point() else t
            continue
        w = t.float()
        check_finite(module, w)
        q, ref = writer.quantize(w)
        out.tensors.update({f"{module}.{k}": v for k, v in q.items()})
        out.formats[module] = writer
        if keep_refs:
            out.refs[module] = ref
    return out


def unused_patterns(patterns: list[str], modules) -> list[str]:
    modules = list(modules)
    return [p for p in patterns if not any(pattern_matches(p, m) for m in modules)]


def modules_of(tensors) -> set[str]:
    return {split_tensor_name(n)[0] for n in tensors}


def declarations(q: Written, exclude: list[str]) -> tuple[dict, dict | None]:
    """(quantization_config, hf_quant_config.json or None): one format's own config when every quantized module
    is in that format, else ModelOpt MIXED_PRECISION naming each quantized module with its format."""
    from ..errors import SpecloomError
    from .rtn import mixed_config

    names = {w.name: w for w in q.formats.values()}
    if not names:
        raise SpecloomError("nothing to quantize: every linear is excluded (or none has a width the format fits)")
    exclude = list(dict.fromkeys(exclude + sorted(q.unfit)))
    if len(names) == 1:
        return next(iter(names.values())).config(exclude)
    return mixed_config(q.formats, exclude)
