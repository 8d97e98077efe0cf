"""Typed, bounded reads of a model's `config.json` fields: a wrong type, an absurd size or an inconsistency is one
SpecloomError naming the field, raised before anything is allocated.

The bounds are generous sanity limits (several times the largest open models), not architecture rules: they
keep a corrupt or hostile config (`hidden_size` 10**9, `vocab_size` 10**12) from asking for terabytes.
"""

from __future__ import annotations

import math

from .errors import SpecloomError

_MISSING = object()

# field -> (least, most)
BOUNDS = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1 << 10),
    "num_attention_heads": (1, 1 << 10),
    "num_key_value_heads": (1, 1 << 10),
    "head_dim": (1, 1 << 12),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "sliding_window_pattern": (1, 1 << 10),
    "original_max_position_embeddings": (1, 1 << 24),
    "medusa_num_heads": (1, 64),
    "medusa_num_layers": (1, 64),
    "num_nextn_predict_layers": (1, 64),  # MTP layers
    "block_size": (1, 256),  # DFlash / DSpark tokens per block
    "markov_rank": (0, 1 << 14),
    "token_id": (0, 1 << 22),
    "draft_depth": (1, 256),  # drafts per step, tree width, tree nodes
}


def _where(key: str, prefix: str, what: str = "model config") -> str:
    return f"{what} field {prefix}{key}"


def config_dict(cfg, what: str = "model config") -> dict:
    """`cfg` itself when it is a JSON object."""
    if not isinstance(cfg, dict):
        raise SpecloomError(f"{what} must be a JSON object, got {type(cfg).__name__}")
    return cfg


def int_field(cfg: dict, key: str, default=_MISSING, prefix: str = "", what: str = "model config",
              bound: str | None = None) -> int:
    """cfg[key] as an int within BOUNDS[bound or key] (an integral float is accepted; a string, a bool or null is
    not). `default`: the value when the key is absent or null (absent with no default: an error). `what` names
    the config in messages ("model config", "drafter config")."""
    v = cfg.get(key)
    if v is None:
        if default is _MISSING:
            raise SpecloomError(f"{what} is missing the key {prefix + key!r}")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecloomError(f"{_where(key, prefix, what)} must be an integer, got {v!r}")
    lo, hi = BOUNDS.get(bound or key, (0, 1 << 62))
    if not lo <= v <= hi:
        raise SpecloomError(f"{_where(key, prefix, what)} must be an integer in [{lo}, {hi}], got {v}")
    return v


def float_field(cfg: dict, key: str, default=_MISSING, positive: bool = True, prefix: str = "",
                what: str = "model config") -> float:
    """cfg[key] as a finite float (> 0 when `positive`)."""
    v = cfg.get(key)
    if v is None:
        if default is _MISSING:
            raise SpecloomError(f"{what} is missing the key {prefix + key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        kind = "a positive number" if positive else "a finite number"
        raise SpecloomError(f"{_where(key, prefix, what)} must be {kind}, got {v!r}")
    return float(v)


def bool_field(cfg: dict, key: str, default: bool, prefix: str = "", what: str = "model config") -> bool:
    """cfg[key] as a JSON boolean (a string such as "false" is not one); `default` when absent or null."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise SpecloomError(f"{_where(key, prefix, what)} must be true or false, got {v!r}")
    return v


def str_field(cfg: dict, key: str, default: str, prefix: str = "", what: str = "model config") -> str:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise SpecloomError(f"{_where(key, prefix, what)} must be a string, got {v!r}")
    return v


def layer_ids(cfg: dict, key: str, prefix: str = "", what: str = "model config") -> list[int] | None:
    """cfg[key] as a list of integer layer ids (None when absent or null; the range is the caller's to check,
    against the target's depth)."""
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > BOUNDS["num_hidden_layers"][1] or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise SpecloomError(f"{_where(key, prefix, what)} must be a list of layer ids, got {v!r}")
    return v


def sub_dict(cfg: dict, key: str, what: str = "model config") -> dict:
    """cfg[key] when it is an object; {} when absent or null."""
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise SpecloomError(f"{_where(key, '', what)} must be an object, got {type(v).__name__}")
    return v


def check_attention_shape(hidden: int, heads: int, kv_heads: int, head_dim_given: bool,
                          what: str = "model config") -> None:
    """Heads that divide the hidden size (when head_dim is derived from it) and query heads that the key/value
    heads divide."""
    if not head_dim_given and hidden % heads:
        raise SpecloomError(f"{what}: num_attention_heads ({heads}) must divide hidden_size ({hidden}) "
                            "when head_dim is not given")
    if kv_heads > heads or heads % kv_heads:
        raise SpecloomError(f"{what}: num_key_value_heads ({kv_heads}) must divide num_attention_heads "
                            f"({heads})")
