"""Block drafter checkpoint formats (DFlash, DFlash 2, DSpark; drafters.md §5.4, §5.5, §6.2, §6.3, §7): read and
write.

Layouts read (one `BlockDraftConfig` comes out of each):
* `zlab` -- z-lab DFlash: `architectures: ["DFlashDraftModel"]`, `num_hidden_layers` = draft depth,
  `num_target_layers`, `block_size` (top level or in `dflash_config`), `dflash_config.{target_layer_ids,
  mask_token_id}`; ids are decoder-layer outputs (ours = id + 1). Tensors `fc`, `hidden_norm`, `norm`, `layers.*`.
  Our default for `dflash`.
* `dflash2` -- z-lab DFlash 2 (PyPI `dflash` 0.1.0): as `zlab` with `architectures: ["DFlash2DraftModel"]` and
  `dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k, input_embedding_scale,
  output_multiplier, final_logit_softcapping}`; extra tensors `layers.{l}.{attention_conv,mlp_conv}.{base_kernel,
  kernel_projection.weight}` and `candidate_selector.{predecessor_codebook, successor_codebook}` (no `.weight`),
  `candidate_selector.hidden_projection.weight`. The only DFlash 2 layout (speculators' is not public).
* `speculators` -- `speculators_model_type` dflash | dspark: `transformer_layer_config`, `block_size`,
  `aux_hidden_state_layer_ids` (HF ids), `mask_token_id`, `sample_from_anchor`, `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov`; tensors as z-lab plus `markov_head.*`,
  `confidence_head.*` (copies of `embed_tokens` / `lm_head` are ignored: the target's are used).
* `deepspec` -- DeepSpec `Qwen3DSparkModel`: top-level Qwen3 keys, `target_layer_ids` (decoder-layer outputs).
* `builtin` -- DSpark inside a target checkpoint (DeepSeek-V4 style): the target's `config.json` carries
  `dspark_block_size`, `dspark_target_layer_ids` (decoder-layer outputs), `dspark_markov_rank`,
  `dspark_markov_head_type`, `dspark_noise_token_id` (the mask), `n_mtp_layers` (draft layers),
  `enable_confidence_head` (+ our `dspark_intermediate_size`); tensors `mtp.0.main_proj`, `mtp.0.main_norm`,
  `mtp.{s}.<Qwen3 layer>`, and the heads at the last stage `mtp.{S-1}.{norm, markov_head.*, confidence_head.*}`.
  Layer shapes are the target's. An *overlay* (the same config keys and `mtp.*` tensors without the target's
  weights) is what specloom bundles for GGUF targets and what `specloom train dspark` writes.

Our metadata lives in the `specloom` block of `config.json`; inside a target's own config.json it is written as
`specloom_dspark` so that it never collides with the target's (or another built-in drafter's) block.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from ...config_fields import (bool_field, check_attention_shape, float_field, int_field, layer_ids,
                             str_field, sub_dict)
from ...errors import DrafterMismatch, SpecloomError
from ...models.cpu_packing import pack_linears
from ..base import export_form
from ..checkpoint import (add_to_target_checkpoint, checkpoint_format, read_prefixed, read_tensors, take,
                          weights_file)
from ..speculators_format import SPECULATORS_VERSION, rope_keys, speculators_config
from .model import MARKOV_TYPES, BlockDraftConfig, BlockDraftModel

DSPARK_FILE = "model-dspark.safetensors"


def layout_of(raw: dict) -> str:
    """zlab | speculators-dflash | speculators-dspark | deepspec | builtin | dflash2 | <other kind>."""
    if "dspark_block_size" in raw:
        return "builtin"
    st = raw.get("speculators_model_type")
    if st:
        return f"speculators-{st}"
    archs = " ".join(raw.get("architectures") or [])
    if "DFlash2" in archs:
        return "dflash2"
    if "DSpark" in archs:
        return "deepspec"
    if "DFlash" in archs or "dflash_config" in raw:
        return "zlab"
    kind = (raw.get("specloom") or {}).get("kind")
    if kind:
        return kind
    if "medusa_num_heads" in raw:
        return "medusa"
    if "draft_vocab_size" in raw or "eagle_config" in raw:
        return "eagle3"
    return "a target model" if "num_hidden_layers" in raw and "model_type" in raw else "unknown"


LAYOUTS = {"dflash": ("zlab", "speculators-dflash"), "dflash2": ("dflash2",),
           "dspark": ("builtin", "speculators-dspark", "deepspec")}


def meta_of(raw: dict) -> dict:
    """Our metadata: `specloom_dspark` inside a target's config.json, else a `specloom` block of a block drafter
    (a target's own `specloom` block, e.g. of a draft model, is not ours to read)."""
    m = raw.get("specloom_dspark") or raw.get("specloom") or {}
    return m if m.get("kind") in (None, "dflash", "dflash2", "dspark") else {}


def default_zlab_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: one layer for one draft layer, else spread over layers 1..L-3 (decoder-layer outputs)."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


def check_layout(path: str, raw: dict, method: str) -> str:
    """The layout of a checkpoint `method` can serve, or a clear error naming what it is instead."""
    layout = layout_of(raw)
    if layout in LAYOUTS[method]:
        return layout
    if layout == "dflash2":
        raise SpecloomError(f'{path}: a DFlash 2 checkpoint (DFlash2DraftModel), not {method} (use "method": '
                            '"dflash2")')
    other = {"zlab": "dflash", "speculators-dflash": "dflash", "speculators-dspark": "dspark",
             "deepspec": "dspark", "builtin": "dspark"}.get(layout, layout.replace("speculators-", ""))
    if method == "dspark" and other == "a target model":
        raise SpecloomError(f"{path}: this target checkpoint has no built-in DSpark drafter (no dspark_block_size "
                            "in its config.json)")
    hint = f' (use "method": "{other}")' if other in ("dflash", "dflash2", "dspark", "eagle", "eagle3", "medusa", "mtp") else ""
    raise SpecloomError(f"{path}: this is a {other} checkpoint, not {method}{hint}")


def block_config(path: str, raw: dict, target_config, method: str) -> BlockDraftConfig:
    """Parse any layout into a BlockDraftConfig for this target, every field typed and bounded (config_fields.py)
    before anything is built; one clear error for what cannot work."""
    layout = check_layout(path, raw, method)
    what = f"{path}: {method} drafter config"
    tc = target_config
    L = tc.num_layers
    lp = ""  # where the layer fields sit, for messages

    def i(cfg, key, *default, bound=None, prefix=""):
        return int_field(cfg, key, *default, prefix=prefix, what=what, bound=bound)

    def b(cfg, key, default):
        return bool_field(cfg, key, default, what=what)

    if layout == "builtin":
        lc = {"hidden_size": tc.hidden_size, "num_attention_heads": tc.num_heads,
              "num_key_value_heads": tc.num_kv_heads, "head_dim": tc.head_dim,
              "intermediate_size": i(raw, "dspark_intermediate_size", tc.intermediate_size, bound="intermediate_size"),
              "vocab_size": tc.vocab_size, "rms_norm_eps": tc.rms_norm_eps, "rope_theta": tc.rope_theta,
              "num_hidden_layers": i(raw, "n_mtp_layers", 3, bound="num_hidden_layers")}
        zids = layer_ids(raw, "dspark_target_layer_ids", what=what)
        ids = None if zids is None else [z + 1 for z in zids]
        extra = dict(block_size=i(raw, "dspark_block_size", bound="block_size"),
                     mask_token_id=i(raw, "dspark_noise_token_id", bound="token_id"), anchor_predicts=True,
                     markov_rank=i(raw, "dspark_markov_rank", 0, bound="markov_rank"),
                     markov_head_type=str_field(raw, "dspark_markov_head_type", "vanilla", what=what),
                     confidence_head=b(raw, "enable_confidence_head", False),
                     confidence_with_markov=b(raw, "dspark_confidence_head_with_markov", True))
    elif layout.startswith("speculators"):
        lc = sub_dict(raw, "transformer_layer_config", what)
        lp = "transformer_layer_config."
        ids = (layer_ids(raw, "aux_hidden_state_layer_ids", what=what)
               or layer_ids(raw, "eagle_aux_hidden_state_layer_ids", what=what))
        dspark = layout == "speculators-dspark"
        extra = dict(block_size=i(raw, "block_size", 8), mask_token_id=i(raw, "mask_token_id", bound="token_id"),
                     anchor_predicts=b(raw, "sample_from_anchor", dspark),
                     markov_rank=i(raw, "markov_rank", 256) if dspark else 0,
                     markov_head_type=str_field(raw, "markov_head_type", "vanilla", what=what),
                     confidence_head=b(raw, "enable_confidence_head", False) and dspark,
                     confidence_with_markov=b(raw, "confidence_head_with_markov", True))
        dv = i(raw, "draft_vocab_size", None, bound="vocab_size")
        if dv and dv != i(lc, "vocab_size", tc.vocab_size, prefix=lp):
            extra["draft_vocab_size"] = dv  # its own lm_head [dv, H], markov_w2 [dv, r] and d2t
    else:  # zlab, deepspec: a Qwen3 config at the top level
        lc = raw
        dc = sub_dict(raw, "dflash_config", what)
        zids = layer_ids(dc, "target_layer_ids", "dflash_config.", what)
        if zids is None:
            zids = layer_ids(raw, "target_layer_ids", what=what)
        if zids is None:
            zids = default_zlab_ids(i(raw, "num_target_layers", L, bound="num_hidden_layers"), i(raw, "num_hidden_layers"))
        ids = [z + 1 for z in zids]
        deepspec = layout == "deepspec"
        mask = i(dc, "mask_token_id", None, bound="token_id", prefix="dflash_config.")
        extra = dict(block_size=i(dc, "block_size", i(raw, "block_size", 16), prefix="dflash_config."),
                     mask_token_id=i(raw, "mask_token_id", bound="token_id") if mask is None else mask,
                     anchor_predicts=deepspec, markov_rank=i(raw, "markov_rank", 0) if deepspec else 0,
                     markov_head_type=str_field(raw, "markov_head_type", "vanilla", what=what),
                     confidence_head=b(raw, "enable_confidence_head", False) and deepspec,
                     confidence_with_markov=b(raw, "confidence_head_with_markov", True))
        if layout == "dflash2":
            extra.update(
                conv_kernel_size=i(dc, "conv_kernel_size", 2, prefix="dflash_config.", bound="block_size"),
                conv_group_size=i(dc, "conv_group_size", 1, prefix="dflash_config.", bound="hidden_size"),
                selector_rank=i(dc, "selector_rank", 256, prefix="dflash_config.", bound="markov_rank"),
                selector_top_k=i(dc, "selector_top_k", 16, prefix="dflash_config.", bound="vocab_size"),
                input_embedding_scale=float_field(dc, "input_embedding_scale", 1.0, prefix="dflash_config.",
                                                  what=what),
                output_multiplier=float_field(dc, "output_multiplier", 1.0, prefix="dflash_config.", what=what),
                final_logit_softcapping=float_field(dc, "final_logit_softcapping", 0.0, prefix="dflash_config.",
                                                    what=what) or None)
        if raw.get("is_causal") or dc.get("causal") or dc.get("use_swa"):
            raise SpecloomError(f"{path}: causal / sliding-window draft layers are not supported")
    H = i(lc, "hidden_size", prefix=lp)
    heads = i(lc, "num_attention_heads", prefix=lp)
    kv_heads = i(lc, "num_key_value_heads", heads, prefix=lp)
    given = lc.get("head_dim") not in (None, 0)
    check_attention_shape(H, heads, kv_heads, given, what)
    cfg = BlockDraftConfig(
        hidden_size=H, num_layers=i(lc, "num_hidden_layers", prefix=lp), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=i(lc, "head_dim", prefix=lp) if given else H // heads,
        intermediate_size=i(lc, "intermediate_size", prefix=lp), vocab_size=i(lc, "vocab_size", tc.vocab_size,
                                                                            prefix=lp),
        block_size=extra["block_size"], mask_token_id=extra["mask_token_id"], feature_ids=(),
        target_hidden_size=i(raw, "target_hidden_size", H, bound="hidden_size"),
        rms_norm_eps=float_field(lc, "rms_norm_eps", 1e-6, prefix=lp, what=what),
        rope_theta=float_field(lc, "rope_theta", 1000000.0, prefix=lp, what=what),
        anchor_predicts=extra["anchor_predicts"], markov_rank=extra["markov_rank"],
        markov_head_type=extra["markov_head_type"], confidence_head=extra["confidence_head"],
        confidence_with_markov=extra["confidence_with_markov"],
        max_position=i(lc, "max_position_embeddings", tc.max_position, prefix=lp),
        **{k: extra[k] for k in DFLASH2_KEYS if k in extra}, draft_vocab_size=extra.get("draft_vocab_size", 0),
    )
    if not ids:
        ids = layer_ids(meta_of(raw), "feature_ids", "specloom.", what)
    if not ids:
        raise SpecloomError(f"{path}: the {method} drafter config names no target layer ids")
    cfg.feature_ids = tuple(ids)
    bad = [i for i in cfg.feature_ids if not 0 <= i <= L]
    if bad:
        zl = layout not in ("speculators-dflash", "speculators-dspark")
        shown = [i - 1 for i in bad] if zl else bad
        conv = f"decoder-layer output ids, valid -1..{L - 1}" if zl else f"HF hidden_states ids, valid 0..{L}"
        raise SpecloomError(f"{path}: target layer ids {shown} exceed the target's depth: it has {L} layers "
                            f"({conv}); this drafter was made for a deeper model")
    if cfg.block_size < (1 if cfg.anchor_predicts else 2):
        raise SpecloomError(f"{path}: block size {cfg.block_size} drafts nothing")
    if cfg.markov_head_type not in MARKOV_TYPES:
        raise SpecloomError(f"{path}: unknown Markov head type {cfg.markov_head_type!r} (known: {MARKOV_TYPES})")
    if cfg.hidden_size != tc.hidden_size or cfg.target_hidden_size != tc.hidden_size:
        raise DrafterMismatch(f"{path}: drafter hidden size {cfg.hidden_size} (features {cfg.target_hidden_size}), the "
                            f"target's is {tc.hidden_size}: it shares the target's embedding and head, so it was "
                            "made for another model")
    if cfg.vocab_size != tc.vocab_size:
        raise DrafterMismatch(f"{path}: drafter vocabulary {cfg.vocab_size}, target {tc.vocab_size}: it was made for "
                            "another model")
    if not 0 <= cfg.mask_token_id < tc.vocab_size:
        raise SpecloomError(f"{path}: mask token id {cfg.mask_token_id} lies outside the target's vocabulary")
    if cfg.num_layers < 1:
        raise SpecloomError(f"{path}: the drafter has no layers")
    if cfg.draft_vocab_size and cfg.selector_rank:
        raise SpecloomError(f"{path}: a DFlash 2 drafter with a reduced draft vocabulary is not supported")
    if layout == "dflash2":
        if cfg.conv_kernel_size < 1 or cfg.hidden_size % cfg.conv_group_size:
            raise SpecloomError(f"{path}: dflash_config.conv_kernel_size {cfg.conv_kernel_size} / conv_group_size "
                                f"{cfg.conv_group_size} cannot shape a conv over hidden size {cfg.hidden_size}")
        if cfg.selector_rank < 1 or cfg.selector_top_k < 1:
            raise SpecloomError(f"{path}: a DFlash 2 drafter needs its candidate selector (dflash_config."
                                f"selector_rank {cfg.selector_rank}, selector_top_k {cfg.selector_top_k})")
    return cfg


DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale",
                "output_multiplier", "final_logit_softcapping")


# -- tensor names ------------------------------------------------------------------------------------------------

def expected_shapes(cfg: BlockDraftConfig) -> dict[str, tuple]:
    """Our (= z-lab / speculators) names -> shapes."""
    H, qd, kvd, inter, d = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                            cfg.intermediate_size, cfg.head_dim)
    exp = {"fc.weight": (H, len(cfg.feature_ids) * cfg.target_hidden_size), "hidden_norm.weight": (H,),
           "norm.weight": (H,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        exp.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (qd, H), p + "self_attn.k_proj.weight": (kvd, H),
            p + "self_attn.v_proj.weight": (kvd, H), p + "self_attn.o_proj.weight": (H, qd),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        })
    r, V, dv = cfg.markov_rank, cfg.vocab_size, cfg.draft_vocab_size
    if dv:
        exp.update({"lm_head.weight": (dv, H), "d2t": (dv,)})
    if r:
        exp.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (dv or V, r)})
        if cfg.markov_head_type == "gated":
            exp.update({"markov_head.gate_proj.weight": (r, H + r), "markov_head.gate_proj.bias": (r,)})
        elif cfg.markov_head_type == "rnn":
            exp.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + H),
                        "markov_head.joint_proj.bias": (3 * r,)})
    if cfg.confidence_head:
        w = H + (r if r and cfg.confidence_with_markov else 0)
        exp.update({"confidence_head.proj.weight": (1, w), "confidence_head.proj.bias": (1,)})
    K, G = cfg.conv_kernel_size, cfg.conv_group_size
    for i in range(cfg.num_layers if K else 0):
        for conv in ("attention_conv", "mlp_conv"):
            exp.update({f"layers.{i}.{conv}.base_kernel": (2, K, H),
                        f"layers.{i}.{conv}.kernel_projection.weight": (2 * K * (H // G), H)})
    if cfg.selector_rank:
        sr = cfg.selector_rank
        exp.update({"candidate_selector.predecessor_codebook": (V, sr),
                    "candidate_selector.successor_codebook": (V, sr),
                    "candidate_selector.hidden_projection.weight": (sr, H)})
    return exp


def to_builtin_name(name: str, num_layers: int) -> str:
    last = f"mtp.{num_layers - 1}."
    if name == "fc.weight":
        return "mtp.0.main_proj.weight"
    if name == "hidden_norm.weight":
        return "mtp.0.main_norm.weight"
    if name.startswith("layers."):
        return "mtp." + name[len("layers."):]
    return last + name  # norm, markov_head.*, confidence_head.*: the head stack at the last stage


def build_block(path: str, raw: dict, target, method: str) -> BlockDraftModel:
    cfg = block_config(path, raw, target.config, method)
    cfg.rope_scaling = target.config.rope_scaling if cfg.rope_theta == target.config.rope_theta else None
    exp = expected_shapes(cfg)
    if layout_of(raw) == "builtin":
        tensors = read_prefixed(path, ("mtp.",))
        state = {n: take(tensors, to_builtin_name(n, cfg.num_layers), s, path) for n, s in exp.items()}
    else:
        wf = weights_file(path)
        tensors = read_tensors(wf)
        if cfg.selector_rank and not any(n.startswith("candidate_selector.") for n in tensors):
            raise SpecloomError(f"{wf}: this DFlash 2 checkpoint has no candidate selector (no candidate_selector.* "
                                "tensors; its config asks for one of rank "
                                f"{cfg.selector_rank}): it is incomplete -- a plain DFlash drafter is served with "
                                '"method": "dflash"')
        state = {n: take(tensors, n, s, wf) for n, s in exp.items()}
    with torch.device("meta"):
        model = BlockDraftModel(cfg)
    model.to_empty(device=target.device)
    dt = target.dtype
    # assign=True keeps the given tensors: they must already sit on the target's device
    model.load_state_dict({k: v.to(device=target.device, dtype=dt if v.is_floating_point() else torch.long)
                           for k, v in state.items()}, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.attach_target(target)
    pack_linears(model)
    if cfg.draft_vocab_size:
        ids = torch.arange(cfg.draft_vocab_size, device=model.d2t.device) + model.d2t
        if ids.min() < 0 or ids.max() >= cfg.vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise SpecloomError(f"{path}: d2t does not map the {cfg.draft_vocab_size} draft ids to increasing "
                                f"target ids in [0, {cfg.vocab_size}) (target id = draft id + d2t[draft id])")
        model.use_draft_vocab(ids, model.lm_head)
    return model


# -- writing -----------------------------------------------------------------------------------------------------

def _state(model: BlockDraftModel, dtype) -> dict:
    """The weights in `dtype` (an integer tensor, d2t, as it is)."""
    return {k: v.detach().cpu().to(dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in model.state_dict().items()}


def _full_vocabulary(cfg: BlockDraftConfig, layout: str) -> None:
    if cfg.draft_vocab_size:
        raise ValueError(f"a block drafter with a reduced draft vocabulary is written in the speculators layout "
                         f"only (its d2t), not {layout}")


def _qwen3_keys(cfg: BlockDraftConfig) -> dict:
    return {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        **rope_keys(cfg.rope_theta, cfg.rope_scaling), "max_position_embeddings": cfg.max_position,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    }


def _write(path: str, raw: dict, sd: dict, file: str = "model.safetensors") -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, file))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)


def _meta(meta: dict, cfg: BlockDraftConfig) -> dict:
    return {**meta, "feature_ids": list(cfg.feature_ids)}


def save_zlab(model: BlockDraftModel, path: str, meta: dict, dtype=torch.bfloat16, num_target_layers=None) -> None:
    cfg = model.config
    _full_vocabulary(cfg, "z-lab's")
    if cfg.markov_rank or cfg.confidence_head or cfg.anchor_predicts:
        raise ValueError("the z-lab DFlash format has no Markov/confidence heads and no anchor slot")
    zids = [i - 1 for i in cfg.feature_ids]
    L = num_target_layers or (meta.get("target_fingerprint") or {}).get("num_layers") or max(cfg.feature_ids)
    raw = {"architectures": ["DFlashDraftModel"], **_qwen3_keys(cfg), "num_target_layers": L,
           "block_size": cfg.block_size, "target_hidden_size": cfg.target_hidden_size,
           "dflash_config": {"target_layer_ids": zids, "mask_token_id": cfg.mask_token_id,
                             "block_size": cfg.block_size},
           "specloom": _meta(meta, cfg)}
    _write(path, raw, _state(model, dtype))


def save_dflash2(model: BlockDraftModel, path: str, meta: dict, dtype=torch.bfloat16,
                 num_target_layers=None) -> None:
    """The z-lab DFlash 2 layout (`DFlash2DraftModel`)."""
    cfg = model.config
    if not (cfg.conv_kernel_size and cfg.selector_rank) or cfg.markov_rank or cfg.confidence_head \
            or cfg.anchor_predicts:
        raise ValueError("a DFlash 2 checkpoint has the convs and the selector, no Markov/confidence head, no "
                         "anchor slot")
    zids = [i - 1 for i in cfg.feature_ids]
    L = num_target_layers or (meta.get("target_fingerprint") or {}).get("num_layers") or max(cfg.feature_ids)
    dc = {"target_layer_ids": zids, "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size,
          **{k: getattr(cfg, k) for k in DFLASH2_KEYS}}
    dc["final_logit_softcapping"] = dc["final_logit_softcapping"] or None
    raw = {"architectures": ["DFlash2DraftModel"], **_qwen3_keys(cfg), "num_target_layers": L,
           "block_size": cfg.block_size, "target_hidden_size": cfg.target_hidden_size, "dflash_config": dc,
           "specloom": _meta(meta, cfg)}
    _write(path, raw, _state(model, dtype))


def save_speculators(model: BlockDraftModel, path: str, meta: dict, kind: str, dtype=torch.bfloat16,
                     verifier: str = "", verifier_architectures: list[str] | None = None) -> None:
    """`verifier`: the target's HF id or directory, `verifier_architectures` its HF architectures (what
    `vllm serve <this dir>` loads as the target)."""
    cfg = model.config
    if kind == "dflash" and (cfg.markov_rank or cfg.confidence_head):
        raise ValueError("a speculators dflash checkpoint has no Markov/confidence heads: save it as dspark")
    if kind == "dspark" and cfg.confidence_head and cfg.confidence_with_markov and not cfg.markov_rank:
        cfg = dataclasses.replace(cfg, confidence_with_markov=False)  # the same head (nothing to read without one)
    raw = {
        "architectures": ["DFlashSpeculator" if kind == "dflash" else "DSparkSpeculator"],
        "speculators_model_type": kind, "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators_config(kind, cfg.num_drafts, verifier, verifier_architectures),
        "transformer_layer_config": _qwen3_keys(cfg),
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "block_size": cfg.block_size,
        "target_hidden_size": cfg.target_hidden_size, "aux_hidden_state_layer_ids": list(cfg.feature_ids),
        "mask_token_id": cfg.mask_token_id, "sliding_window_non_causal": True,
        "sample_from_anchor": cfg.anchor_predicts,
    }
    if kind == "dspark":
        raw.update({"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
                    "enable_confidence_head": cfg.confidence_head,
                    "confidence_head_with_markov": cfg.confidence_with_markov})
    raw["specloom"] = _meta(meta, cfg)
    sd = _state(model, dtype)
    vocab = model.draft_vocab
    if vocab is not None and not cfg.draft_vocab_size:
        # reduced at run time (FR-Spec, `draft_vocab`): written as speculators' reduced vocabulary, so vLLM serves
        # what specloom serves -- the head's rows as lm_head, the Markov output's rows, d2t
        n = len(vocab)
        sd["lm_head.weight"] = model._shared["head"].weight.detach().cpu().to(dtype).contiguous()
        if cfg.markov_rank:
            sd["markov_head.markov_w2.weight"] = model._shared["markov_w2"].weight.detach().cpu().to(dtype).contiguous()
        sd["d2t"] = vocab.cpu() - torch.arange(n)
        raw["draft_vocab_size"] = n
    if raw["draft_vocab_size"] != cfg.vocab_size:  # t2d (the target ids it holds): speculators' converter reads it
        sd["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        sd["t2d"][torch.arange(raw["draft_vocab_size"]) + sd["d2t"]] = True
    _write(path, raw, sd)


def builtin_keys(cfg: BlockDraftConfig) -> dict:
    """The config keys a target checkpoint with a built-in DSpark carries."""
    if not cfg.anchor_predicts:
        raise ValueError("a built-in DSpark drafts from the anchor slot (anchor_predicts=True)")
    return {"dspark_block_size": cfg.block_size, "dspark_target_layer_ids": [i - 1 for i in cfg.feature_ids],
            "dspark_markov_rank": cfg.markov_rank, "dspark_markov_head_type": cfg.markov_head_type,
            "dspark_noise_token_id": cfg.mask_token_id, "n_mtp_layers": cfg.num_layers,
            "enable_confidence_head": cfg.confidence_head,
            "dspark_confidence_head_with_markov": cfg.confidence_with_markov,
            "dspark_intermediate_size": cfg.intermediate_size}


def builtin_state(model: BlockDraftModel, dtype=torch.bfloat16) -> dict:
    _full_vocabulary(model.config, "a target checkpoint's built-in DSpark")
    n = model.config.num_layers
    return {to_builtin_name(k, n): v for k, v in _state(model, dtype).items()}


def save_overlay(model: BlockDraftModel, path: str, meta: dict, dtype=torch.bfloat16) -> None:
    """A DSpark overlay: the config keys and `mtp.*` tensors of a built-in DSpark, without the target's weights
    (bundled next to GGUF targets, found by `method: dspark` without `model`)."""
    cfg = model.config
    raw = {**builtin_keys(cfg), "specloom": _meta(meta, cfg)}
    _write(path, raw, builtin_state(model, dtype))


def add_to_target_dir(model: BlockDraftModel, target_dir: str, meta: dict, dtype=torch.bfloat16) -> None:
    """Build a DSpark into a target's HF directory: its tensors go to `model-dspark.safetensors` (added to the
    weight index when there is one), its keys into the target's config.json."""
    add_to_target_checkpoint(target_dir, DSPARK_FILE, builtin_state(model, dtype), builtin_keys(model.config),
                             "specloom_dspark", _meta(meta, model.config), replace_prefix="mtp.")


# -- registration ------------------------------------------------------------------------------------------------

class _BlockFormat:
    method = ""

    @classmethod
    def read_config(cls, path: str, raw: dict) -> None:
        check_layout(path, raw, cls.method)

    @classmethod
    def build(cls, path: str, raw: dict, target):
        return build_block(path, raw, target, cls.method)


@checkpoint_format("dflash")
class DFlashFormat(_BlockFormat):
    method = "dflash"

    @classmethod
    def save(cls, model, path: str, meta: dict, fmt: str = "zlab", **kw) -> None:
        if fmt == "zlab":
            save_zlab(model, path, meta, **kw)
        elif fmt == "speculators":
            save_speculators(model, path, meta, "dflash", **kw)
        else:
            raise ValueError(f"unknown DFlash format {fmt!r} (zlab | speculators)")


@checkpoint_format("dflash2")
class DFlash2Format(_BlockFormat):
    method = "dflash2"

    @classmethod
    def save(cls, model, path: str, meta: dict, fmt: str = "zlab", **kw) -> None:
        if fmt != "zlab":
            raise ValueError(f"unknown DFlash 2 format {fmt!r} (zlab: speculators' DFlash 2 layout is not public)")
        save_dflash2(model, path, meta, **kw)


@checkpoint_format("dspark")
class DSparkFormat(_BlockFormat):
    method = "dspark"

    @classmethod
    def save(cls, model, path: str, meta: dict, fmt: str = "overlay", **kw) -> None:
        if fmt == "overlay":
            save_overlay(model, path, meta, **kw)
        elif fmt == "speculators":
            save_speculators(model, path, meta, "dspark", **kw)
        elif fmt == "target":  # path = an existing target HF directory
            add_to_target_dir(model, path, meta, **kw)
        else:
            raise ValueError(f"unknown DSpark format {fmt!r} (overlay | speculators | target)")


@export_form("dflash")
def save_dflash_speculators(model: BlockDraftModel, path: str, meta: dict, **kw) -> None:
    """`specloom export`'s form of a DFlash drafter (one with a Markov or confidence head is a DSpark one)."""
    if model.config.markov_rank or model.config.confidence_head:
        raise SpecloomError("this block drafter has a Markov or confidence head: export it as dspark")
    save_speculators(model, path, meta, "dflash", **kw)


@export_form("dspark")
def save_dspark_speculators(model: BlockDraftModel, path: str, meta: dict, **kw) -> None:
    """`specloom export`'s form of a DSpark drafter."""
    save_speculators(model, path, meta, "dspark", **kw)
