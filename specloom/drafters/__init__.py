"""Drafters, one sub-package per kind (its drafter, the network shared by training and inference, its checkpoint
formats and its trainer): ngram, suffix, draft_model, medusa, eagle (eagle, eagle3), mtp, block (dflash, dspark).

Each kind registers itself with one record (`@register(name, keys, trainers)` in base.py: the drafter class, its
own `--speculative-config` keys with their checks, its trainer modules); importing this package registers all of
them. The engine looks a method up in `DRAFTERS` / `KINDS` and never branches on its name."""

from . import block, draft_model, eagle, medusa, mtp, ngram, suffix  # noqa: F401  (registration)
from .base import DRAFTERS, KINDS, DraftContext, Drafter, Kind, register

__all__ = ["DRAFTERS", "KINDS", "DraftContext", "Drafter", "Kind", "register"]
