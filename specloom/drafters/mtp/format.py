"""MTP layers in the DeepSeek-V3 checkpoint layout (drafters.md §4.2): read from a target checkpoint, write into one.

A target HF directory declares `num_nextn_predict_layers: N` in `config.json`; MTP layer i lives under
`model.layers.{L+i}.` (L = `num_hidden_layers`): `enorm`, `hnorm`, `eh_proj`, the decoder block with the target's
own tensor names (`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`, ...) and `shared_head.norm`. `embed_tokens` and `shared_head.head` are the target's
embedding and LM head: ignored when present, not written (the loaders of vLLM and SGLang map them onto the shared
ones too). The target loader skips these layers; this module reads them.

Written three ways: into a copy of a target checkpoint (`save_into_target`: an extra `model-mtp.safetensors`, the
config and index updated), as an overlay (`save_overlay`: config keys + the MTP tensors only), which is how
specloom bundles MTP layers for a GGUF target, or in the speculators format (`save_speculators`,
`speculators_model_type: "mtp"`: one MTP layer of a Qwen3 target, tensors `mtp_layers.0.*` with `token_layernorm`
= enorm, `hidden_layernorm` = hnorm, `input_proj` = eh_proj, `final_layernorm` = shared_head.norm, the decoder
block's own names; `transformer_layer_config` = the target's Qwen3 config). All three are read back. Our metadata
sits under `specloom_mtp` in a target's config, `specloom` in the others.
"""

from __future__ import annotations

import json
import os

import torch

from ...config_fields import int_field, sub_dict
from ...errors import SpecloomError
from ...models.cpu_packing import pack_linears
from ..base import export_form
from ..checkpoint import _load_json, add_to_target_checkpoint, check_target, find_builtin_dir, read_prefixed, take
from .model import MTPModel

MTP_FILE = "model-mtp.safetensors"


def declares_mtp(raw: dict) -> bool:
    """The config names MTP layers (their count is checked by read_mtp_config)."""
    return raw.get("num_nextn_predict_layers") not in (None, 0, False)


def find_mtp_dir(model: str | None, target_config) -> str:
    if model:
        if not os.path.isdir(model):
            raise SpecloomError(f"mtp: {model!r} is not a checkpoint directory")
        return model
    return find_builtin_dir("mtp", target_config, declares_mtp)


# speculators `mtp` names (within `mtp_layers.0.`) of the MTP-specific tensors; the decoder block's keep theirs
SPECULATORS_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
                     "eh_proj.weight": "input_proj.weight", "shared_head.norm.weight": "final_layernorm.weight"}


def is_speculators(raw: dict) -> bool:
    return raw.get("speculators_model_type") == "mtp"


def read_mtp_config(path: str, target_config) -> dict:
    """The checkpoint's config.json, every field we read typed and bounded (config_fields.py) and compared with the
    target before anything is built."""
    raw = _load_json(os.path.join(path, "config.json"))
    if not declares_mtp(raw):
        raise SpecloomError(f"{path}: the checkpoint declares no MTP layers (config.json has no "
                            "num_nextn_predict_layers > 0)")
    what = f"{path}: mtp drafter config"
    int_field(raw, "num_nextn_predict_layers", what=what)
    tc = target_config
    # a speculators checkpoint describes the target's layers in transformer_layer_config
    shape = sub_dict(raw, "transformer_layer_config", what) if is_speculators(raw) else raw
    for key, mine in (("hidden_size", tc.hidden_size), ("vocab_size", tc.vocab_size),
                      ("num_hidden_layers", tc.num_layers)):
        theirs = int_field(shape, key, mine, what=what)
        if theirs != mine:
            raise SpecloomError(f"{path}: MTP layers for {key} {theirs}, but the target has {mine}")
    meta = sub_dict(raw, "specloom_mtp", what) or sub_dict(raw, "specloom", what)
    for key in ("depth", "tree_width", "num_draft_tokens"):  # the drafter's defaults (drafter.py)
        int_field(meta, key, None, prefix="specloom.", what=what, bound="draft_depth")
    return raw


def _hf_names(model: MTPModel, speculators: bool = False) -> dict[str, tuple[str, ...]]:
    """Our parameter name (within one MTP layer) -> the HF tensor names it is made of (fused q/k/v, gate/up);
    `speculators`: the names of the speculators `mtp` layout."""
    out = {}
    for name in model.layers[0].state_dict():
        hf = name.replace("block.", "", 1)
        if speculators:
            hf = SPECULATORS_NAMES.get(hf, hf)
        if "qkv_proj" in hf:
            out[name] = tuple(hf.replace("qkv_proj", f"{x}_proj") for x in "qkv")
        elif "gate_up_proj" in hf:
            out[name] = tuple(hf.replace("gate_up_proj", f"{x}_proj") for x in ("gate", "up"))
        else:
            out[name] = (hf,)
    return out


def load_mtp(path: str, target, tokenizer=None) -> tuple[MTPModel, dict]:
    tc = target.config
    raw = read_mtp_config(path, tc)
    N = int(raw["num_nextn_predict_layers"])
    L = tc.num_layers
    meta = raw.get("specloom_mtp") or raw.get("specloom") or {}
    with torch.device("meta"):  # the expected shapes, nothing allocated: every tensor is checked first
        shapes = MTPModel(tc, N)
    spec = is_speculators(raw)
    prefixes = tuple(f"mtp_layers.{i}." if spec else f"model.layers.{L + i}." for i in range(N))
    tensors = read_prefixed(path, prefixes)
    own = shapes.state_dict()
    state = {}
    offset = tc.family_spec.norm_weight_offset  # Gemma: (1 + w) norms, folded as the target loader folds them
    for i in range(N):
        prefix = prefixes[i]
        where = f"{path}: the config declares {N} MTP layer(s) (num_nextn_predict_layers) but"
        for name, sources in _hf_names(shapes, spec).items():
            shape = own[f"layers.{i}.{name}"].shape
            if name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight") or len(sources) == 1:
                if prefix + sources[0] not in tensors:
                    raise SpecloomError(f"{where} tensor {prefix + sources[0]!r} is missing")
                t = take(tensors, prefix + sources[0], tuple(shape), path)
            else:
                missing = [prefix + s for s in sources if prefix + s not in tensors]
                if missing:
                    raise SpecloomError(f"{where} tensor {missing[0]!r} is missing")
                t = torch.cat([tensors[prefix + s] for s in sources], 0)
                if tuple(t.shape) != tuple(shape):
                    raise SpecloomError(f"{path}: {prefix}{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            if offset and name.startswith("block.") and name.endswith("norm.weight"):
                t = t.float() + offset
            state[f"layers.{i}.{name}"] = t.float()
    model = MTPModel(tc, N)
    model.load_state_dict(state)
    model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    model.attach_target(target)
    pack_linears(model)  # its own linears in the drafting kernel (the head is the target's)
    if tokenizer is not None:
        check_target(meta, target, tokenizer, path)
    return model, meta


def mtp_tensors(model: MTPModel, L: int, dtype=torch.bfloat16, speculators: bool = False) -> dict[str, torch.Tensor]:
    offset = model.config.family_spec.norm_weight_offset
    out = {}
    names = _hf_names(model, speculators)
    for i, layer in enumerate(model.layers):
        sd = layer.state_dict()
        prefix = f"mtp_layers.{i}." if speculators else f"model.layers.{L + i}."
        for name, sources in names.items():
            t = sd[name].detach().float().cpu()
            if offset and name.startswith("block.") and name.endswith("norm.weight"):
                t = t - offset
            if "qkv_proj" in name:
                c = model.config
                q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
                parts = t.split([q, kv, kv], 0)
            else:
                parts = t.split(t.shape[0] // len(sources), 0) if len(sources) > 1 else (t,)
            for s, part in zip(sources, parts):
                out[prefix + s] = part.to(dtype).contiguous()
    return out


def _mtp_config_keys(model: MTPModel, L: int) -> dict:
    return {"num_nextn_predict_layers": model.num_layers, "num_hidden_layers": L}


def save_overlay(model: MTPModel, path: str, meta: dict, dtype=torch.bfloat16) -> None:
    """Config keys + MTP tensors only (a bundle for a target that cannot carry them, e.g. a GGUF file)."""
    from safetensors.torch import save_file

    c = model.config
    L = c.num_layers
    os.makedirs(path, exist_ok=True)
    save_file(mtp_tensors(model, L, dtype), os.path.join(path, MTP_FILE))
    raw = {"model_type": c.model_type, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
           **_mtp_config_keys(model, L), "specloom": meta}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)


def save_into_target(model: MTPModel, target_dir: str, meta: dict, dtype=torch.bfloat16) -> None:
    """Add the MTP layers to a target HF directory (DeepSeek layout): `model-mtp.safetensors`, config keys, and
    the weight index when the checkpoint is sharded."""
    L = int(_load_json(os.path.join(target_dir, "config.json"))["num_hidden_layers"])
    add_to_target_checkpoint(target_dir, MTP_FILE, mtp_tensors(model, L, dtype), _mtp_config_keys(model, L),
                             "specloom_mtp", meta)


def _qwen3_only(model_type: str, target_name: str) -> None:
    """Only a Qwen3 target's MTP layer has a speculators form (checked before any weights load)."""
    if model_type != "qwen3":
        raise SpecloomError(f"{target_name}: a {model_type} target; the speculators mtp format has Qwen3 decoder "
                            "layers only (qwen3, qwen3_next, qwen3_5): its MTP layers have no speculators form")


@export_form("mtp", net=lambda drafter: drafter.mtp, tokens=lambda spec, meta, net: spec.num_speculative_tokens or 1,
             check_target=_qwen3_only, vllm=False)
def save_speculators(model: MTPModel, path: str, meta: dict, dtype=torch.bfloat16, verifier: str = "",
                     verifier_architectures: list[str] | None = None) -> None:
    """The speculators `mtp` layout (what its MTPDraftModel loads): one MTP layer of a Qwen3 target. Its
    recursion differs from ours past the first step (speculators feeds the next step the final-normed output, we
    and vLLM's DeepSeek-style MTP models the pre-norm one), so `speculative_tokens` is the layer count, 1."""
    from safetensors.torch import save_file

    from ..speculators_format import SPECULATORS_VERSION, rope_keys, speculators_config

    c = model.config
    if c.model_type != "qwen3":
        raise SpecloomError(f"the speculators mtp format has Qwen3 decoder layers only (qwen3, qwen3_next, qwen3_5); "
                            f"these MTP layers are {c.model_type} layers: no speculators form")
    if model.num_layers != 1:
        raise SpecloomError(f"the speculators mtp format holds one MTP layer; this drafter has {model.num_layers}")
    layer = {"model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
             "num_hidden_layers": c.num_layers, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
             **rope_keys(c.rope_theta, c.rope_scaling), "max_position_embeddings": c.max_position,
             "hidden_act": "silu", "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias}
    raw = {"architectures": ["MTPDraftModel"], "speculators_model_type": "mtp",
           "speculators_version": SPECULATORS_VERSION,
           "speculators_config": speculators_config("mtp", 1, verifier, verifier_architectures or ["Qwen3ForCausalLM"]),
           "transformer_layer_config": layer, "num_nextn_predict_layers": 1, "specloom": meta}
    os.makedirs(path, exist_ok=True)
    save_file(mtp_tensors(model, c.num_layers, dtype, speculators=True), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
