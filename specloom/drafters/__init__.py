"""Drafters, one sub-package per kind (its drafter, the network shared by training and inference, its checkpoint
formats and its trainer): ngram, suffix, draft_model, medusa, eagle (eagle, eagle3), mtp, block (dflash, dspark).

Each kind is one record (base.py `Kind`: the drafter class, its own `--speculative-config` keys with their checks,
its checkpoint format, its speculators export form, its trainers and their `specloom train` options), filled by
decorators in its own folder. Importing this package imports every sub-package (`discover`), so adding a kind is
adding its folder: nothing outside it names it. The engine looks a method up in `DRAFTERS` / `KINDS` and never
branches on its name. May import: what lies below the step (models/, loading/, kv, tree, verify, sampling,
training/'s toolkit), never the step, the engine, serving/, bench/ or jobs/."""

import importlib
import pkgutil

from .base import DRAFTERS, KINDS, DraftContext, Drafter, Kind, register


def discover() -> list[str]:
    """Import every kind folder on this package's path (each registers its record); returns the kinds known."""
    for m in pkgutil.iter_modules(__path__):
        if m.ispkg:
            importlib.import_module(f"{__name__}.{m.name}")
    return list(KINDS)


discover()

from .suffix.hybrid import SuffixFirst  # noqa: E402  (suffix decoding in front of any kind)


def kv_cache_type(spec):
    """The spec's `kv_cache_dtype` as a kv_quant.KVType (None: the drafter's default)."""
    from ..kv_quant import parse_kv_cache_dtype

    return parse_kv_cache_dtype(getattr(spec, "kv_cache_dtype", None), "kv_cache_dtype")


def create_drafter(spec, target, tokenizer) -> Drafter:
    """The drafter `spec` asks for (its kind's `create`), behind suffix decoding when `suffix_decoding` is set."""
    drafter = DRAFTERS[spec.method].create(spec, target, tokenizer)
    drafter.kv_cache_dtype = kv_cache_type(spec)  # the type of its own companion KV stores (None: default)
    return SuffixFirst.wrap(drafter, spec, target.config) if spec.suffix_decoding else drafter


__all__ = ["DRAFTERS", "KINDS", "DraftContext", "Drafter", "Kind", "create_drafter", "discover", "register"]
