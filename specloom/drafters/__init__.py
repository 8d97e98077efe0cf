"""Drafters, one sub-package per kind (its drafter, the network shared by training and inference, its checkpoint
formats and its trainer): ngram, suffix, draft_model, medusa, eagle (eagle, eagle3), mtp, block (dflash, dspark).

Each kind registers itself with one record (`@register(name, keys, trainers)` in base.py: the drafter class, its
own `--speculative-config` keys with their checks, its trainer modules); importing this package registers all of
them. The engine looks a method up in `DRAFTERS` / `KINDS` and never branches on its name."""

from . import block, draft_model, eagle, medusa, mtp, ngram, suffix  # noqa: F401  (registration)
from .base import DRAFTERS, KINDS, DraftContext, Drafter, Kind, register
from .suffix.hybrid import SuffixFirst


def kv_cache_type(spec):
    """The spec's `kv_cache_dtype` as a kv_quant.KVType (None: the drafter's default)."""
    from ..kv_quant import parse_kv_cache_dtype

    return parse_kv_cache_dtype(getattr(spec, "kv_cache_dtype", None), "kv_cache_dtype")


def create_drafter(spec, target, tokenizer) -> Drafter:
    """The drafter `spec` asks for (its kind's `create`), behind suffix decoding when `suffix_decoding` is set."""
    drafter = DRAFTERS[spec.method].create(spec, target, tokenizer)
    drafter.kv_cache_dtype = kv_cache_type(spec)  # the type of its own companion KV stores (None: default)
    return SuffixFirst.wrap(drafter, spec, target.config) if spec.suffix_decoding else drafter


__all__ = ["DRAFTERS", "KINDS", "DraftContext", "Drafter", "Kind", "create_drafter", "register"]
