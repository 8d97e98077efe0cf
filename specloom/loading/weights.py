"""Build a target model from a HF-convention state dict (names and conventions of HF transformers).

Both loaders (HF directory, GGUF) produce the same HF-convention dict; this module is the one place that maps it
onto specloom's modules: strips the `model.` prefix, fuses q/k/v and gate/up, folds Gemma's `1 + w` norm
convention into the weight, and re-ties the head to the embedding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ..config import ModelConfig
from ..errors import SpecloomError
from ..models import FAMILIES, DecoderLM

_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def _strip(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def _builtin_drafter_tensor(name: str, num_layers: int) -> bool:
    if name.startswith("mtp."):
        return True
    m = re.match(r"layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= num_layers


def convert_hf_state_dict(config: ModelConfig, items: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype):
    """HF names/tensors -> specloom names/tensors, converted to `dtype` (fusions done in fp32-exact concat)."""
    sd: dict[str, torch.Tensor] = {}
    for name, t in items:
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.")):
            continue
        if "rotary_emb" in name:
            continue
        name = _strip(name)
        if _builtin_drafter_tensor(name, config.num_layers):
            continue  # MTP layers (DeepSeek layout) and DSpark stages: read by their drafters, not the target
        sd[name] = t
    gemma = config.family == "gemma3"
    out: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        try:
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat(
                    [sd.pop(p + f"self_attn.{x}_proj.{kind}") for x in "qkv"], dim=0
                )
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [sd.pop(p + "mlp.gate_proj.weight"), sd.pop(p + "mlp.up_proj.weight")], dim=0
            )
        except KeyError as e:
            raise SpecloomError(f"malformed checkpoint: tensor {e.args[0]!r} is missing") from None
    for name, t in sd.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[name] = t
    for name in list(out):
        t = out[name]
        if gemma and re.search(r"(layernorm|norm)\.weight$", name):
            t = t.float() + 1.0  # Gemma's RMSNorm multiplies by (1 + w)
        out[name] = t.to(dtype)
    return out


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> DecoderLM:
    """Instantiate the family's model without random init and load `state` (specloom names) strictly."""
    cls = FAMILIES[config.family]
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device=device)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing:
        raise SpecloomError(f"malformed checkpoint: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise SpecloomError(f"malformed checkpoint: unexpected tensors {unexpected[:5]}")
    own = model.state_dict()
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise SpecloomError(
                f"malformed checkpoint: {name} has shape {tuple(t.shape)}, the config implies {tuple(own[name].shape)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    return model

