"""HF tensor names of MoE checkpoints onto the per-expert names the loader fuses (see models/moe.py).

* A family's `hf_renames` (FamilySpec) rewrite its own names first: Mixtral's `block_sparse_moe.experts.{e}.w1`
  becomes `mlp.experts.{e}.gate_proj`.
* transformers >= 5 holds the experts of a layer in memory as two 3-D tensors, `mlp.experts.gate_up_proj`
  [E, 2I, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I]; `save_pretrained` writes them per
  expert. A state dict taken from a model in memory is split here into the per-expert layout, so both load alike.
* Tensors that belong to no linear layer (`gate.e_score_correction_bias`, DeepSeek-V3's selection bias) load as
  they are, outside the weight-format registry.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

PLAIN_TENSORS = frozenset({"e_score_correction_bias"})

_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


def per_expert(name: str, t) -> Iterator[tuple[str, object]]:
    """(name, tensor), or, for a fused 3-D expert tensor held in memory, one (name, tensor) per expert and
    projection."""
    m = _FUSED.match(name)
    if m is None or not isinstance(t, torch.Tensor) or t.dim() != 3:
        yield name, t
        return
    prefix, kind = m.groups()
    for e in range(t.shape[0]):
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            gate, up = t[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
