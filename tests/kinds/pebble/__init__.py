"""`pebble`: a drafter kind that exists only to show that a kind is one folder. tests/test_kind_record.py puts
tests/kinds/ on specloom.drafters' path; nothing in specloom/ names this kind. Its drafter repeats the root token
`pebble_repeat` times (a guess verification accepts or rejects like any other), with a one-number network that a
checkpoint format reads and writes, an export form and a trainer with one option of its own. Its files import
exactly as a folder under specloom/drafters/ would (it is imported as `specloom.drafters.pebble`)."""

from . import format  # noqa: F401  (checkpoint and export form registration)
from .drafter import PebbleDrafter  # noqa: F401  (registration)
