"""`--speculative-config`: vLLM's JSON keys, parsed and checked up front.

The common keys (vLLM's names) are checked here: `method`, `model`, `num_speculative_tokens`,
`disable_by_batch_size`, `draft_tensor_parallel_size` (must be 1 here), `kv_cache_dtype` (the type of the drafter's own
KV stores, kv_quant.py; only for kinds that keep one: `Drafter.keeps_kv`). Every other key belongs to a drafter kind,
which declares it with its check in its registration record (drafters/base.py `Kind.keys`): e.g. `tree_width` and
`num_draft_tokens` (trees: draft_model, eagle, eagle3, mtp; medusa takes `num_draft_tokens`), `draft_vocab` /
`token_map` (draft_model, eagle, eagle3, mtp, dflash, dflash2, dspark: a frequency-ranked reduced draft vocabulary), `draft_kernel` (draft_model: the
draft model's linear kernel, e.g. `int8`),
`prompt_lookup_min` / `prompt_lookup_max` (ngram), `suffix_decoding_*` (suffix), `confidence_threshold` (dflash,
dspark). A key no kind knows is refused with the list of known ones; a key of another kind is refused naming the
method's own keys. Nothing is silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .drafters import DRAFTERS, KINDS, Kind
from .drafters.suffix.hybrid import KEYS as HYBRID_KEYS
from .errors import SpecloomError

MAX_SPECULATIVE_TOKENS = 64
COMMON_KEYS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "disable_by_batch_size",
               "suffix_decoding", "kv_cache_dtype"}


def _all_keys() -> set[str]:
    return COMMON_KEYS | set(HYBRID_KEYS) | {k for kind in KINDS.values() for k in kind.keys}


def _suffix_keys() -> dict:
    """The keys `"suffix_decoding": true` adds to any method: suffix decoding's own and the hybrid's."""
    return {**KINDS["suffix"].keys, **HYBRID_KEYS}


@dataclass(frozen=True)
class SpeculativeConfig:
    """The common keys, plus `options`: the method's own keys (and the hybrid's, with suffix_decoding) as
    checked by their kinds, read as attributes (`spec.tree_width`; None where not given)."""

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    disable_by_batch_size: int | None = None
    suffix_decoding: bool = False  # suffix decoding in front of the method's drafter (drafters/suffix/hybrid.py)
    kv_cache_dtype: str | None = None  # the drafter's own KV type (kv_quant.KV_TYPES name; None: its default)
    options: tuple = ()  # ((key, value), ...) sorted: the kind's own keys that were given

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "options":
            raise AttributeError(name)
        if name in dict(self.options):
            return dict(self.options)[name]
        if name in _all_keys():
            return None  # a key some kind takes, not given here
        raise AttributeError(f"{type(self).__name__!r} has no key {name!r}")

    @classmethod
    def parse(cls, spec: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise SpecloomError(f"--speculative-config is not valid JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(spec, dict):
            raise SpecloomError("--speculative-config must be a JSON object, e.g. '{\"method\": \"ngram\"}'")
        unknown = sorted(set(spec) - _all_keys())
        if unknown:
            raise SpecloomError(f"unknown --speculative-config keys {unknown}; known keys: {sorted(_all_keys())}")
        method = spec.get("method")
        if method is None and spec.get("model"):
            method = "draft_model"  # vLLM infers the method from the model; a plain model means a draft model
        if not isinstance(method, str):
            raise SpecloomError("--speculative-config needs a \"method\" (one of " + ", ".join(DRAFTERS) + ")")
        k = spec.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise SpecloomError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        d = spec.get("disable_by_batch_size")
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise SpecloomError(f"disable_by_batch_size must be a positive integer, got {d!r}")
        if spec.get("draft_tensor_parallel_size", 1) != 1:
            raise SpecloomError("draft_tensor_parallel_size must be 1 (specloom runs on one device)")
        if method not in DRAFTERS:
            raise SpecloomError(f"unknown speculative method {method!r} (known: {', '.join(DRAFTERS)})")
        kind = KINDS[method]
        hybrid = spec.get("suffix_decoding", False)
        if not isinstance(hybrid, bool):
            raise SpecloomError(f"suffix_decoding must be true or false, got {hybrid!r}")
        if hybrid and method == "suffix":
            raise SpecloomError("suffix_decoding puts suffix decoding in front of another method's drafter; "
                                "with method 'suffix' drop it")
        kv_type = _kv_cache_dtype(spec.get("kv_cache_dtype"), kind)
        keys = {**kind.keys, **(_suffix_keys() if hybrid else {})}
        own = {}
        for key in sorted(set(spec) - COMMON_KEYS):
            if key not in keys:
                extra = ("; suffix_decoding_* keys need \"suffix_decoding\": true"
                         if key in _suffix_keys() and method != "suffix" else "")
                raise SpecloomError(
                    f"speculative method {method!r} does not take {key!r} (its own keys: "
                    f"{', '.join(sorted(kind.keys)) or 'none'}; common keys: {', '.join(sorted(COMMON_KEYS))}"
                    f"{extra})")
            if spec[key] is not None:
                own[key] = keys[key](key, spec[key])
        return cls(method=method, model=spec.get("model"), num_speculative_tokens=k, disable_by_batch_size=d,
                   suffix_decoding=hybrid, kv_cache_dtype=kv_type, options=tuple(sorted(own.items())))


def _kv_cache_dtype(value, kind: Kind) -> str | None:
    """The checked `kv_cache_dtype` (its canonical name; None for auto / absent). Only a drafter that keeps keys
    and values of its own takes one."""
    from .kv_quant import parse_kv_cache_dtype

    t = parse_kv_cache_dtype(value, "kv_cache_dtype")
    if t is not None and not getattr(kind.drafter, "keeps_kv", False):
        own = sorted(k for k, v in KINDS.items() if getattr(v.drafter, "keeps_kv", False))
        raise SpecloomError(f"speculative method {kind.name!r} keeps no KV cache of its own, so it takes no "
                            f"kv_cache_dtype (the methods that do: {', '.join(own)}; the target's KV type is "
                            "--kv-cache-dtype)")
    return None if t is None else t.name
