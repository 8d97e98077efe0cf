"""`suffix`: suffix decoding (no weights): per-request and global suffix tries, draft trees by frequency."""

from .drafter import SuffixDrafter  # noqa: F401  (registration)
