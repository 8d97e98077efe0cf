"""What a checkpoint's configuration says about the number format of each module.

Sources, read in this order (the first that declares a quantized format for a module wins):
* `hf_quant_config.json` (NVIDIA ModelOpt): `{"quantization": {"quant_algo", "group_size", "exclude_modules",
  "quantized_layers"}}`;
* config.json's `quantization_config`, by `quant_method`: `modelopt` (the same keys, flat or under
  `quantization`), `fp8` (DeepSeek / HF fine-grained FP8: `weight_block_size`, `modules_to_not_convert`),
  `compressed-tensors` (`config_groups` -> per-target weight schemes, `ignore`), `mxfp4` (gpt-oss); plus
  DeepSeek-V4's top-level `expert_dtype: "fp4"` (routed experts in MXFP4).

`declared(module)` answers per module name (as the checkpoint spells it): an algorithm name (`FP8`, `NVFP4`,
`MXFP4`, or whatever the file says -- the registry in formats.py decides whether it knows it), `DENSE` (excluded
or, under MIXED_PRECISION, not listed) or None (nothing declared). Patterns: glob (`*` `?`) matched against the
module name with and without its `model.` prefix and against its parents; `re:` prefix = regular expression.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from ..errors import SpecloomError

DENSE = "DENSE"
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


@dataclass(frozen=True)
class Declared:
    algo: str | None  # FP8 / NVFP4 / MXFP4 / ... , DENSE, or None
    where: str  # what said so, for messages
    explicit: bool = False  # this module is named itself (MIXED_PRECISION's quantized_layers)
    params: dict = field(default_factory=dict)  # group_size, block_size


def _names(module: str) -> list[str]:
    out = [module]
    for p in _PREFIXES:
        if module.startswith(p):
            out.append(module[len(p):])
            break
    return out


def pattern_matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return any(re.match(pattern[3:], n) for n in _names(module))
    return any(fnmatchcase(n, pattern) or fnmatchcase(n, pattern + ".*") for n in _names(module))


@dataclass
class Source:
    where: str  # "hf_quant_config.json", "config.json quantization_config (fp8)"
    rules: list[tuple[tuple[str, ...], str, dict]]  # (patterns, algo, params) -- first match wins
    default: str | None  # the algo of a module no rule names (DENSE under MIXED_PRECISION)
    params: dict
    excludes: tuple[str, ...] = ()
    explicit_rules: bool = False  # rules name modules (quantized_layers), not targets

    def declared(self, module: str) -> Declared | None:
        for p in self.excludes:
            if pattern_matches(p, module):
                return Declared(DENSE, f"{self.where} excludes it (pattern {p!r})")
        for patterns, algo, params in self.rules:
            hit = next((p for p in patterns if pattern_matches(p, module)), None)
            if hit is not None:
                what = f"lists it as {algo}" if self.explicit_rules else f"declares {algo} for {hit!r}"
                return Declared(algo.upper(), f"{self.where} {what}", self.explicit_rules,
                                {**self.params, **params})
        if self.default is None:
            return None
        why = "lists it in no quantized_layers entry" if self.default == DENSE else f"declares {self.default}"
        return Declared(self.default, f"{self.where} {why}", False, dict(self.params))


def _patterns(q: dict, *keys: str) -> tuple[str, ...]:
    out: list[str] = []
    for k in keys:
        v = q.get(k) or []
        out += [v] if isinstance(v, str) else [str(x) for x in v]
    return tuple(out)


def _modelopt(q: dict, where: str) -> Source:
    q = q.get("quantization", q)
    params = {k: q[k] for k in ("group_size",) if k in q}
    layers = q.get("quantized_layers")
    if layers:  # MIXED_PRECISION: each quantized module named, every other one dense
        rules = [((name,), str(spec.get("quant_algo")), {k: spec[k] for k in ("group_size",) if k in spec})
                 for name, spec in layers.items()]
        return Source(where, rules, DENSE, params, _patterns(q, "exclude_modules", "ignore"), True)
    algo = q.get("quant_algo")  # none: only the KV cache is quantized (kv_cache_quant_algo)
    return Source(where, [], str(algo).upper() if algo else None, params, _patterns(q, "exclude_modules", "ignore"))


def _fp8(q: dict, where: str) -> Source:
    params = {"block_size": tuple(q["weight_block_size"])} if q.get("weight_block_size") else {}
    return Source(where, [], "FP8", params, _patterns(q, "modules_to_not_convert", "ignored_layers", "ignore"))


def _mxfp4(q: dict, where: str) -> Source:
    return Source(where, [], "MXFP4", {}, _patterns(q, "modules_to_not_convert", "ignore"))


# compressed-tensors weight schemes -> algorithm: (num_bits, type, group_size or None)
_CT_SCHEMES = {(8, "float", None): "FP8", (4, "float", 16): "NVFP4", (4, "float", 32): "MXFP4"}


def _compressed_tensors(q: dict, where: str) -> Source:
    rules = []
    for gname, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        key = (w.get("num_bits"), w.get("type"), w.get("group_size") if w.get("num_bits") == 4 else None)
        algo = _CT_SCHEMES.get(key, f"compressed-tensors {gname} {key}")
        targets = tuple("*" if t == "Linear" else t for t in group.get("targets") or ["Linear"])
        params = {"block_size": tuple(w["block_structure"])} if w.get("block_structure") else {}
        rules.append((targets, algo, params))
    return Source(where, rules, None, {}, _patterns(q, "ignore"))


_METHODS = {"modelopt": _modelopt, "fp8": _fp8, "mxfp4": _mxfp4, "compressed-tensors": _compressed_tensors}


class QuantConfig:
    """Every declaration a checkpoint makes about number formats, answered per module."""

    def __init__(self, sources: list[Source], raw: dict | None = None):
        self.sources = sources
        self.raw = raw or {}
        self.seen: list[str] = []

    def get(self, key, default=None):  # the config.json quantization_config's own keys
        return self.raw.get(key, default)

    def declared(self, module: str) -> Declared | None:
        first = None
        for s in self.sources:
            d = s.declared(module)
            if d is not None and d.algo != DENSE:
                return d
            first = first or d
        return first

    def note_modules(self, modules) -> None:
        """Every module the checkpoint holds (drafter layers included): what the exclude patterns are checked on."""
        self.seen.extend(modules)

    def unused_excludes(self) -> list[tuple[str, str]]:
        return [(s.where, p) for s in self.sources for p in s.excludes
                if not any(pattern_matches(p, m) for m in self.seen)]


def _source_of(q: dict, where: str, raw: dict) -> Source:
    method = str(q.get("quant_method", "modelopt" if "quant_algo" in q or "quantization" in q else ""))
    parse = _METHODS.get(method.lower())
    if parse is None:
        raise SpecloomError(f"{where}: unknown quant_method {method!r} (known: {', '.join(_METHODS)})")
    src = parse(q, f"{where} ({method})")
    if raw.get("expert_dtype") == "fp4":  # DeepSeek-V4: routed experts in MXFP4, the rest as declared
        src.rules.insert(0, (("*.experts.*",), "MXFP4", {}))
    return src


def read_quant_config(raw: dict, directory: str | None = None) -> QuantConfig | None:
    """The declarations of a checkpoint: its config.json `raw` and, in `directory`, hf_quant_config.json."""
    sources = []
    if directory:
        path = os.path.join(directory, "hf_quant_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    q = json.load(f)
            except (OSError, ValueError) as e:
                raise SpecloomError(f"{path}: unreadable ({e})") from None
            if not isinstance(q, dict):
                raise SpecloomError(f"{path}: expected a JSON object")
            sources.append(_modelopt(q, "hf_quant_config.json"))
    q = raw.get("quantization_config")
    if isinstance(q, dict) and q:
        sources.append(_source_of(q, "config.json quantization_config", raw))
    return QuantConfig(sources, q if isinstance(q, dict) else None) if sources else None


def as_quant_config(q) -> QuantConfig | None:
    """A `QuantConfig`, or one made from a `quantization_config` dict (None: nothing declared)."""
    if q is None or isinstance(q, QuantConfig):
        return q
    return read_quant_config({"quantization_config": q})
