"""`--speculative-config`: vLLM's JSON keys, parsed and checked up front.

Accepted keys (vLLM's names): `method`, `model`, `num_speculative_tokens`, `prompt_lookup_min`,
`prompt_lookup_max`, `draft_tensor_parallel_size` (must be 1 here), `disable_by_batch_size`; ours:
`tree_width` (top-k expanded per depth: a tree instead of a chain; draft_model, eagle, eagle3),
`num_draft_tokens` (tree nodes kept, SGLang's `speculative_num_draft_tokens`), `confidence_threshold` (dspark: stop
the block before the first slot whose confidence is below it; 0 = off). Unknown keys are refused with the list of known
ones, never silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .drafters import DRAFTERS
from .errors import SpecloomError

KNOWN_METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp", "dflash", "dspark")
MAX_SPECULATIVE_TOKENS = 64
_KEYS = {
    "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
    "draft_tensor_parallel_size", "disable_by_batch_size", "tree_width", "num_draft_tokens", "confidence_threshold",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    tree_width: int | None = None
    num_draft_tokens: int | None = None
    confidence_threshold: float | None = None

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
        unknown = sorted(set(spec) - _KEYS)
        if unknown:
            raise SpecloomError(f"unknown --speculative-config keys {unknown}; known keys: {sorted(_KEYS)}")
        method = spec.get("method")
        if method is None and spec.get("model"):
            method = "draft_model"  # vLLM infers the method from the model; a plain model means a draft model
        if not isinstance(method, str):
            raise SpecloomError("--speculative-config needs a \"method\" (one of " + ", ".join(KNOWN_METHODS) + ")")
        k = spec.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise SpecloomError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        w = spec.get("tree_width")
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= 16):
            raise SpecloomError(f"tree_width must be an integer in [1, 16], got {w!r}")
        nd = spec.get("num_draft_tokens")
        if nd is not None and (not isinstance(nd, int) or isinstance(nd, bool) or not 1 <= nd <= 256):
            raise SpecloomError(f"num_draft_tokens must be an integer in [1, 256], got {nd!r}")
        ct = spec.get("confidence_threshold")
        if ct is not None and (not isinstance(ct, (int, float)) or isinstance(ct, bool) or not 0.0 <= ct <= 1.0):
            raise SpecloomError(f"confidence_threshold must be a number in [0, 1], got {ct!r}")
        if spec.get("draft_tensor_parallel_size", 1) != 1:
            raise SpecloomError("draft_tensor_parallel_size must be 1 (specloom runs on one device)")
        if method not in DRAFTERS:
            if method in KNOWN_METHODS:
                raise SpecloomError(
                    f"speculative method {method!r} is not available yet in this version of specloom "
                    f"(available: {', '.join(sorted(DRAFTERS)) or 'none'})"
                )
            raise SpecloomError(f"unknown speculative method {method!r} (known: {', '.join(KNOWN_METHODS)})")
        return cls(
            method=method,
            model=spec.get("model"),
            num_speculative_tokens=k,
            prompt_lookup_min=spec.get("prompt_lookup_min"),
            prompt_lookup_max=spec.get("prompt_lookup_max"),
            disable_by_batch_size=spec.get("disable_by_batch_size"),
            tree_width=w,
            num_draft_tokens=nd,
            confidence_threshold=None if ct is None else float(ct),
        )
