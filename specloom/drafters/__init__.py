"""Drafters register themselves by name (`@register("ngram")`); importing this package registers all of them.
The engine looks a method up in `DRAFTERS` and never branches on its name."""

from . import draft_model, eagle, eagle_format, medusa, medusa_format, mtp, ngram  # noqa: F401  (registration)
from . import block, block_format  # noqa: F401  (registration)
from .base import DRAFTERS, DraftContext, Drafter, register

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "register"]
