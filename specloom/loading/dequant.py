"""Dequantise a drafter's tensors (or any tensor dict a loader reads outside the target's path), deciding the
format per module exactly as the target loader does: `dense_tensors(tensors, raw_config, directory)`.

A module none of whose tensors looks like a quantized format (dense weights, `d2t`, norms) passes unchanged; any
other goes through `formats.format_for` with the directory's own declarations (its config.json
`quantization_config`, its hf_quant_config.json), so a drafter stored in a format its config does not declare
fails with one message naming the directory and the module.
"""

from __future__ import annotations

import torch

from ..errors import SpecloomError
from .formats import FORMATS, format_for, split_tensor_name
from .quant_config import read_quant_config


def _looks_quantized(tensors: dict) -> bool:
    return any(getattr(f, "quantized", False) and f.problems("", tensors, {}) is not None for f in FORMATS.values())


def dense_tensors(tensors: dict[str, torch.Tensor], raw: dict, directory: str,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    qc = read_quant_config(raw, directory)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        module, key = split_tensor_name(name)
        groups.setdefault(module, {})[key] = t
    out: dict[str, torch.Tensor] = {}
    for module, ts in groups.items():
        if not _looks_quantized(ts):
            out.update({f"{module}.{k}" if module else k: t for k, t in ts.items()})
            continue
        try:
            fmt = format_for(module, ts, qc)
        except SpecloomError as e:
            raise SpecloomError(f"{directory}: {e}") from None
        out.update({f"{module}.{k}": t for k, t in fmt.load(module, ts, dtype, "cpu", quant_config=qc).items()})
    return out
