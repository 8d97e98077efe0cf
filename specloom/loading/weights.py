"""Build a target model from a HF-convention state dict (names and conventions of HF transformers).

Both loaders (HF directory, GGUF) produce HF-convention names; this module is the one place that maps them onto
specloom's modules: strips the `model.` prefix, asks the weight-format registry (`formats.py`) how each module's
tensors load, fuses q/k/v and gate/up, folds the family's norm convention (Gemma's `1 + w`, the record's
`norm_weight_offset`) into the weight, and re-ties the head to the embedding.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import SpecloomError
from ..models import FAMILIES, DecoderLM
from ..moe_config import gated_mlp_prefixes
from .experts import PLAIN_TENSORS, per_expert, renamed
from .formats import format_for, split_tensor_name
from .quant_base import Quantized
from .quant_config import as_quant_config

RESIDENT = ("dequantized", "quantized")

_NORM_WEIGHT = re.compile(r"(layernorm|norm)\.weight$")

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


def load_state_dict(
    config: ModelConfig,
    items: Iterable[tuple[str, object]],
    dtype: torch.dtype,
    quant_config=None,
    device: str | torch.device = "cpu",
    progress: bool = False,
    resident: str = "dequantized",
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """HF names/tensors -> (specloom names/tensors as `dtype`, {specloom module: weight format it came from}).

    `items` holds whatever the checkpoint stores (torch tensors, `GGUFTensor`s, ...); each module's tensors are
    loaded by the format `formats.format_for` picks for them, checked against what `quant_config` (a
    `QuantConfig`, or HF's `quantization_config` dict) declares for the module. Fusions are exact concatenations.
    `resident="quantized"`: the linears of a quantized format stay quantized (a `Quantized` under
    `<linear>.weight`, which `build_model` runs as a `QuantLinear`); by default every weight is dequantised here."""
    if resident not in RESIDENT:
        raise SpecloomError(f"unknown weights_resident {resident!r} (choose {' or '.join(RESIDENT)})")
    qc, seen, held = as_quant_config(quant_config), {}, {}
    items = _noting(items, seen)
    modules: dict[str, dict[str, object]] = {}
    renames = config.family_spec.hf_renames
    for name, t in items:
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.")):
            continue
        if "rotary_emb" in name:
            continue
        name = _strip(name)
        if _builtin_drafter_tensor(name, config.num_layers):
            continue  # MTP layers (DeepSeek layout) and DSpark stages: read by their drafters, not the target
        for name, t in per_expert(renamed(name, renames), t):  # MoE layouts (loading/experts.py)
            module, key = split_tensor_name(name)
            modules.setdefault(module, {})[key] = t
    if qc is not None:
        qc.note_modules(seen.values())
        warn_unused_excludes(qc)
    linears = _linears(config) if resident == "quantized" else set()
    offset = config.family_spec.norm_weight_offset
    sd: dict[str, torch.Tensor] = {}
    fmt_of: dict[str, str] = {}
    unheld: dict[str, list[str]] = {}  # why -> modules dequantised although blocks were asked for
    for module, tensors in tqdm(modules.items(), desc="loading weights", unit="module", disable=not progress,
                                leave=False):
        for key in PLAIN_TENSORS & set(tensors):  # no linear's tensor: loaded as it is (MoE selection bias)
            sd[f"{module}.{key}"] = tensors.pop(key).to(device=device, dtype=dtype)
        if not tensors:
            continue
        fmt = format_for(module, tensors, qc, checkpoint_name=seen.get(module))
        fmt_of[module] = fmt.name
        # a folded norm is loaded in fp32 and rounded to `dtype` once, after the fold
        load_dtype = torch.float32 if offset and module.endswith("norm") else dtype
        for key, t in _load(fmt, module, tensors, load_dtype, device, qc, seen, held, linears, unheld).items():
            sd[f"{module}.{key}" if module else key] = t
    out: dict[str, torch.Tensor] = {}
    plan: dict[str, str] = {}

    def fused(name: str, parts: list[str]) -> None:
        kinds = {fmt_of.get(p) for p in parts}
        if len(kinds) > 1:
            raise SpecloomError(f"malformed checkpoint: {', '.join(parts)} are stored in different weight formats "
                                f"({', '.join(fmt_of.get(p, '?') for p in parts)}) but run as one {name}")
        plan[name] = kinds.pop()

    for i in range(config.num_layers):
        p = f"layers.{i}."
        try:
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat(
                    [sd.pop(p + f"self_attn.{x}_proj.{kind}") for x in "qkv"], dim=0
                )
            mlps = [p + m for m in gated_mlp_prefixes(config, i)]  # `mlp.`, or each expert of an MoE layer
            for m in mlps:
                out[m + "gate_up_proj.weight"] = torch.cat(
                    [sd.pop(m + "gate_proj.weight"), sd.pop(m + "up_proj.weight")], dim=0
                )
        except KeyError as e:
            raise SpecloomError(f"malformed checkpoint: tensor {e.args[0]!r} is missing") from None
        fused(p + "self_attn.qkv_proj", [p + f"self_attn.{x}_proj" for x in "qkv"])
        for m in mlps:
            fused(m + "gate_up_proj", [m + "gate_proj", m + "up_proj"])
    for name, t in sd.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[name] = t
    for module, fmt in fmt_of.items():
        plan.setdefault(module, fmt)
    if config.tie_word_embeddings and "embed_tokens" in fmt_of:
        plan["lm_head"] = fmt_of["embed_tokens"]  # the head runs the embedding's weight
    for name in list(out):
        t = out[name]
        if offset and _NORM_WEIGHT.search(name):
            t = t.float() + offset  # e.g. Gemma's RMSNorm multiplies by (1 + w)
        out[name] = t.to(dtype)
    _hold(out, held)
    for why, mods in unheld.items():
        print(f"specloom: {why}: {len(mods)} tensor(s) ({mods[0]}{', ...' if len(mods) > 1 else ''}) dequantised to "
              f"{str(dtype).replace('torch.', '')} at load instead", file=sys.stderr, flush=True)
    return out, plan


def _noting(items, seen: dict):
    """`items`, recording {specloom module: the module's name in the checkpoint} (every module, drafters' too)."""
    for name, t in items:
        seen.setdefault(split_tensor_name(_strip(name))[0], split_tensor_name(name)[0])
        yield name, t


def warn_unused_excludes(qc) -> None:
    unused = qc.unused_excludes()
    if unused:
        print("specloom: warning: exclude pattern(s) that match no module of the checkpoint: "
              + "; ".join(f"{p!r} ({where})" for where, p in unused), file=sys.stderr, flush=True)


_PARTS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}
_ORDER = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _fused_name(module: str) -> str:
    head, _, last = module.rpartition(".")
    return f"{head}.{_PARTS[last]}" if last in _PARTS else module


class _shapes_only:
    """Build a model's modules on the meta device without their random init: on meta, `nn.init`'s first call
    imports PyTorch's reference decompositions (~1.2 s of every start-up); the checkpoint sets every weight."""

    NAMES = ("normal_", "uniform_", "kaiming_uniform_", "xavier_uniform_", "trunc_normal_", "zeros_", "ones_")

    def __enter__(self):
        self.meta = torch.device("meta")
        self.meta.__enter__()
        self.saved = {n: getattr(torch.nn.init, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(torch.nn.init, n, lambda tensor, *a, **k: tensor)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.nn.init, n, f)
        return self.meta.__exit__(*exc)


def _linears(config: ModelConfig) -> set[str]:
    """The names of the model's `nn.Linear`s (a meta build: nothing allocated), a tied head excluded."""
    with _shapes_only():
        model = FAMILIES[config.family](config)
    out = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    return out - {"lm_head"} if config.tie_word_embeddings else out


def _load(fmt, module, tensors, dtype, device, qc, seen, held, linears, unheld) -> dict[str, torch.Tensor]:
    """The module's parameters as the loader fuses them. A linear (or an embedding whose format has a kernel for
    one) held quantized gets a meta placeholder for its weight (the fusions concatenate those as they do dense
    ones; `_hold` swaps in the `Quantized`)."""
    name = seen.get(module, module)
    quantized = getattr(fmt, "quantized", False)
    wanted = _fused_name(module) in linears or (module == "embed_tokens" and bool(linears) and hasattr(fmt, "embedding"))
    holdable = wanted and hasattr(fmt, "load_quantized") and fmt.holds(tensors)
    if wanted and not holdable and hasattr(fmt, "not_held") and (why := fmt.not_held(tensors)):
        unheld.setdefault(why, []).append(module)
    if not holdable:
        return fmt.load(name, tensors, dtype, device, quant_config=qc) if quantized else \
            fmt.load(module, tensors, dtype, device)
    qz = held[module] = fmt.load_quantized(name, tensors, dtype, device, qc)
    out = {"weight": torch.empty(qz.shape, dtype=dtype, device="meta")}
    if "bias" in tensors:
        b = tensors["bias"]
        out["bias"] = (fmt.load(module, {"weight": b}, dtype, device)["weight"] if not isinstance(b, torch.Tensor)
                       else b.to(device=device, dtype=dtype))
    return out


def _hold(out: dict, held: dict) -> None:
    groups: dict[str, list[str]] = {}
    for module in held:
        groups.setdefault(_fused_name(module), []).append(module)
    for name, parts in groups.items():
        parts.sort(key=lambda m: _ORDER.index(m.rpartition(".")[2]) if m.rpartition(".")[2] in _ORDER else 0)
        out[f"{name}.weight"] = Quantized.cat([held[m] for m in parts], name)


def convert_hf_state_dict(config: ModelConfig, items: Iterable[tuple[str, object]], dtype: torch.dtype):
    """HF names/tensors -> specloom names/tensors, converted to `dtype` (see `load_state_dict`)."""
    return load_state_dict(config, items, dtype)[0]


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> DecoderLM:
    """Instantiate the family's model without random init and load `state` (specloom names) strictly. A
    `Quantized` entry under `<linear>.weight` puts a `QuantLinear` (held quantized) in that linear's place."""
    cls = FAMILIES[config.family]
    with _shapes_only():
        model = cls(config)  # shapes only: nothing is allocated before the checkpoint matches them
    held = {k[: -len(".weight")]: v for k, v in state.items() if isinstance(v, Quantized)}
    state, bias = dict(state), {}
    compute = next((t.dtype for k, t in state.items() if k.endswith("norm.weight") and isinstance(t, torch.Tensor)),
                   torch.float32)
    embed = held.pop("embed_tokens", None)  # an embedding held as shipped (GGUF): its format's module
    if embed is not None:
        del state["embed_tokens.weight"]
    named = dict(model.named_modules())
    for name, qz in held.items():
        linear = named.get(name)
        if type(linear) is not torch.nn.Linear:
            raise SpecloomError(f"malformed checkpoint: {name} is stored quantized but is not a linear layer")
        if qz.shape != (linear.out_features, linear.in_features):
            raise SpecloomError(f"malformed checkpoint: {name}.weight has shape {qz.shape}, the config implies "
                                f"{(linear.out_features, linear.in_features)}")
        del state[f"{name}.weight"]
        if linear.bias is not None:
            if f"{name}.bias" not in state:
                raise SpecloomError(f"malformed checkpoint: missing tensors ['{name}.bias']")
            bias[name] = state.pop(f"{name}.bias")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, torch.nn.Identity())  # its QuantLinear: below
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    if embed is not None:
        expected.discard("embed_tokens.weight")
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
    model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=True)
    if embed is not None:
        model.embed_tokens = embed.format.embedding(embed, compute)
        if config.tie_word_embeddings:
            model.lm_head = model.embed_tokens.head()  # the same blocks
    elif config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if "embed_tokens.weight" in state:
        compute = state["embed_tokens.weight"].dtype
    for name, qz in held.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, qz.module(compute, bias.get(name)))
    if hasattr(model.lm_head, "fp32_out"):  # a head held as GGML blocks: fp32 logits, never rounded to bf16
        model.lm_head.fp32_out = True
    model.eval().requires_grad_(False)
    return model

