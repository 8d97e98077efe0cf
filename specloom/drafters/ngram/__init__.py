"""`ngram`: prompt lookup (no weights)."""

from .drafter import NgramDrafter  # noqa: F401  (registration)
