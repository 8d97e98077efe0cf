"""EAGLE checkpoint formats (drafters.md §2.4, §3.5, §7): read and write.

* EAGLE-1 (SafeAILab/EAGLE `v1`): LlamaConfig-like `config.json` (`num_hidden_layers: 1`, `bias`) and
  `model.safetensors` / `pytorch_model.bin` with `fc.{weight,bias}`, `layers.0.*` (no input_layernorm, no norm),
  optional `embed_tokens.weight` (ignored: the target's is used).
* EAGLE-3 official: `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, `target_hidden_size`, tensors
  `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`; optional
  `eagle_config.eagle_aux_hidden_state_layer_ids`.
* speculators (`speculators_model_type: "eagle3"`, the format vLLM serves): `transformer_layer_config`, norm flags
  written explicitly, `eagle_aux_hidden_state_layer_ids`, tensors `layers.0.*`.

Our own EAGLE-3 checkpoints are written in the speculators format (plus a `specloom` block); `fmt="eagle"` writes
the official EAGLE-3 layout instead. Feature ids follow the HF hidden_states index (§0.2).
"""

from __future__ import annotations

import os

import torch

from ...config_fields import (bool_field, check_attention_shape, config_dict, float_field, int_field, layer_ids,
                             sub_dict)
from ...errors import DrafterMismatch, SpecloomError
from ...models.cpu_packing import pack_linears
from ..base import export_form
from ..checkpoint import checkpoint_format, read_tensors, take, weights_file
from ..speculators_format import SPECULATORS_VERSION, rope_keys, speculators_config
from .model import EagleConfig, EagleDraftModel


def _kind_of(raw: dict) -> str:
    st = raw.get("speculators_model_type")
    if st:
        return st
    if "medusa_num_heads" in raw:
        return "medusa"
    archs = " ".join(raw.get("architectures") or [])
    if "Eagle3" in archs or "draft_vocab_size" in raw or "eagle_config" in raw:
        return "eagle3"
    if raw.get("specloom", {}).get("kind"):
        return raw["specloom"]["kind"]
    return "eagle"


def _layer_cfg(raw: dict, what: str) -> dict:
    return config_dict(raw.get("transformer_layer_config") or raw, what)


def _config(raw: dict, eagle3: bool, target, where: str) -> EagleConfig:
    """The drafter network's config, every field typed and bounded (config_fields.py) before anything is built."""
    what = f"{where}: drafter config"
    raw = config_dict(raw, what)
    lc = _layer_cfg(raw, what)
    tc = target.config
    H = int_field(lc, "hidden_size", what=what)
    heads = int_field(lc, "num_attention_heads", what=what)
    kv_heads = int_field(lc, "num_key_value_heads", heads, what=what)
    given = lc.get("head_dim") not in (None, 0)
    check_attention_shape(H, heads, kv_heads, given, what)
    vocab = int_field(lc, "vocab_size", int_field(raw, "vocab_size", tc.vocab_size, what=what), what=what)
    cfg = EagleConfig(
        eagle3=eagle3, hidden_size=H, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int_field(lc, "head_dim", what=what) if given else H // heads,
        intermediate_size=int_field(lc, "intermediate_size", what=what),
        vocab_size=vocab,
        draft_vocab_size=int_field(raw, "draft_vocab_size", vocab, what=what, bound="vocab_size"),
        feature_ids=(), target_hidden_size=int_field(raw, "target_hidden_size", H, what=what, bound="hidden_size"),
        rms_norm_eps=float_field(lc, "rms_norm_eps", 1e-6, what=what),
        rope_theta=float_field(lc, "rope_theta", 10000.0, what=what),
        fc_bias=bool(raw.get("bias", True)) and not eagle3,
        max_position=int_field(lc, "max_position_embeddings", 8192, what=what),
        norm_before_fc=bool_field(raw, "norm_before_fc", False, what=what) and eagle3,
        fc_norm=bool_field(raw, "fc_norm", False, what=what) and eagle3,
        norm_output=bool_field(raw, "norm_output", False, what=what) and eagle3,
    )
    if cfg.norm_before_fc and cfg.fc_norm:
        raise SpecloomError(f"{where}: norm_before_fc and fc_norm are both set: they are exclusive (one norm over "
                            "the concatenated features, or one per feature)")
    if not eagle3:
        cfg.draft_vocab_size = cfg.vocab_size
    key = "eagle_aux_hidden_state_layer_ids"
    ids = (layer_ids(raw, key, what=what)
           or layer_ids(sub_dict(raw, "eagle_config", what), key, "eagle_config.", what)
           or layer_ids(sub_dict(raw, "specloom", what), "feature_ids", "specloom.", what))
    L = tc.num_layers
    if not ids:
        ids = (2, L // 2, L - 3) if eagle3 else (L,)
    cfg.feature_ids = tuple(ids)
    bad = [i for i in cfg.feature_ids if not 0 <= i <= L]
    if bad:
        raise SpecloomError(f"{where}: feature layer ids {bad} exceed the target's depth ({L} layers; ids are "
                            f"HF hidden_states indices 0..{L})")
    if cfg.target_hidden_size != tc.hidden_size:
        raise DrafterMismatch(f"{where}: drafter reads features of width {cfg.target_hidden_size}, the target's "
                            f"hidden size is {tc.hidden_size}: it was made for another model")
    if cfg.vocab_size != tc.vocab_size:
        raise DrafterMismatch(f"{where}: drafter vocabulary {cfg.vocab_size}, target {tc.vocab_size}: it was made "
                            "for another model")
    if not eagle3 and cfg.hidden_size != tc.hidden_size:
        raise SpecloomError(f"{where}: EAGLE-1 drafter hidden size {cfg.hidden_size} must equal the target's "
                            f"({tc.hidden_size}): it uses the target's LM head")
    return cfg


def _expected(cfg: EagleConfig) -> dict[str, tuple]:
    H, Hin = cfg.hidden_size, (2 * cfg.hidden_size if cfg.eagle3 else cfg.hidden_size)
    qd, kvd, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    p = "layers.0."
    exp = {
        p + "self_attn.q_proj.weight": (qd, Hin), p + "self_attn.k_proj.weight": (kvd, Hin),
        p + "self_attn.v_proj.weight": (kvd, Hin), p + "self_attn.o_proj.weight": (H, qd),
        p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
        p + "mlp.down_proj.weight": (H, inter), p + "post_attention_layernorm.weight": (H,),
    }
    if cfg.eagle3:
        exp.update({
            "fc.weight": (H, len(cfg.feature_ids) * cfg.target_hidden_size), "norm.weight": (H,),
            "lm_head.weight": (cfg.draft_vocab_size, H), p + "input_layernorm.weight": (H,),
            p + "hidden_norm.weight": (H,),
        })
        if cfg.norm_before_fc:
            exp["input_norm.weight"] = (len(cfg.feature_ids) * cfg.target_hidden_size,)
        if cfg.fc_norm:
            exp.update({f"fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(len(cfg.feature_ids))})
    else:
        exp["fc.weight"] = (H, H + cfg.target_hidden_size)
        if cfg.fc_bias:
            exp["fc.bias"] = (H,)
    return exp


def build_eagle(path: str, raw: dict, target, eagle3: bool) -> EagleDraftModel:
    where = path
    cfg = _config(raw, eagle3, target, where)
    cfg.rope_scaling = target.config.rope_scaling if cfg.rope_theta == target.config.rope_theta else None
    wf = weights_file(path)
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in read_tensors(wf).items()}
    state = {name: take(tensors, name, shape, wf) for name, shape in _expected(cfg).items()}
    if eagle3:
        if cfg.draft_vocab_size != cfg.vocab_size:
            state["d2t"] = take(tensors, "d2t", (cfg.draft_vocab_size,), wf).long()
            state["t2d"] = (take(tensors, "t2d", (cfg.vocab_size,), wf).bool() if "t2d" in tensors
                            else _t2d_from(state["d2t"], cfg.vocab_size))
            ids = torch.arange(cfg.draft_vocab_size) + state["d2t"]
            if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
                raise SpecloomError(f"{wf}: d2t maps draft ids outside the target vocabulary")
        else:
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    with torch.device("meta"):
        model = EagleDraftModel(cfg)
    model.to_empty(device=target.device)
    dt = target.dtype
    # assign=True keeps the given tensors: they must already sit on the target's device
    dev = target.device
    model.load_state_dict({k: (v.to(device=dev, dtype=dt) if v.is_floating_point() else v.to(dev))
                           for k, v in state.items()}, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.attach_target(target)
    pack_linears(model)
    return model


def _t2d_from(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    return t2d


def _llama_keys(cfg: EagleConfig) -> dict:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": 1, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        **rope_keys(cfg.rope_theta, cfg.rope_scaling), "max_position_embeddings": cfg.max_position,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }


def _state(model: EagleDraftModel, dtype) -> dict:
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu()
        sd[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
    if not model.config.eagle3 or model.config.draft_vocab_size == model.config.vocab_size:
        sd.pop("d2t", None)
        sd.pop("t2d", None)
    return sd


def save_eagle(model: EagleDraftModel, path: str, meta: dict, fmt: str = "speculators", dtype=torch.bfloat16,
               verifier: str = "", verifier_architectures: list[str] | None = None) -> None:
    """`verifier`: the target's HF id or directory, `verifier_architectures` its HF architectures (written into
    the speculators config: what `vllm serve <this dir>` loads as the target)."""
    import json

    from safetensors.torch import save_file

    cfg = model.config
    sd = _state(model, dtype)
    if not cfg.eagle3:
        raw = {"architectures": ["LlamaForCausalLM"], **_llama_keys(cfg), "bias": cfg.fc_bias}
    elif fmt == "speculators":
        raw = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": speculators_config("eagle3", meta.get("depth", 3), verifier,
                                                     verifier_architectures or ["LlamaForCausalLM"]),
            "transformer_layer_config": _llama_keys(cfg),
            "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": False,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.feature_ids),
            "norm_before_fc": cfg.norm_before_fc, "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
            "embed_requires_grad": False,
        }
    elif fmt == "eagle":
        if cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output:
            raise ValueError("the official EAGLE-3 layout has no feature or output norms: write the speculators one")
        raw = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_keys(cfg),
               "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_ids),
                                "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                                "use_last_layernorm": True}}
        sd = {k.replace("layers.0.", "midlayer."): v for k, v in sd.items()}
    else:
        raise ValueError(f"unknown EAGLE-3 format {fmt!r} (speculators | eagle)")
    raw["specloom"] = {**meta, "feature_ids": list(cfg.feature_ids)}
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)


class _EagleFormat:
    eagle3 = False
    method = "eagle"

    @classmethod
    def read_config(cls, path: str, raw: dict) -> None:
        kind = _kind_of(raw)
        if kind != cls.method:
            hint = "" if kind not in ("eagle", "eagle3", "medusa") else f' (use "method": "{kind}")'
            raise SpecloomError(f"{path}: this is a {kind} checkpoint, not {cls.method}{hint}")

    @classmethod
    def build(cls, path: str, raw: dict, target):
        return build_eagle(path, raw, target, cls.eagle3)

    @classmethod
    def save(cls, model, path: str, meta: dict, **kw) -> None:
        save_eagle(model, path, meta, **kw)


@checkpoint_format("eagle")
class Eagle1Format(_EagleFormat):
    pass


@checkpoint_format("eagle3")
class Eagle3Format(_EagleFormat):
    eagle3 = True
    method = "eagle3"


@export_form("eagle3", tokens=lambda spec, meta, net: spec.num_speculative_tokens or meta.get("depth") or 3)
def save_eagle3_speculators(model: EagleDraftModel, path: str, meta: dict, **kw) -> None:
    """`specloom export`'s form of an EAGLE-3 drafter: the speculators eagle3 layout (what vLLM serves)."""
    save_eagle(model, path, meta, fmt="speculators", **kw)
