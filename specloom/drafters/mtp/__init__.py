"""`mtp`: DeepSeek-layout multi-token-prediction layers (model.py), run on the EAGLE path (drafter.py); format.py
reads them from a target checkpoint or an overlay; trainer.py (post-hoc) and train_target.py (a new target trained
jointly with its MTP layers)."""

from . import format  # noqa: F401  (checkpoint and export format registration)
from .drafter import MTPDrafter  # noqa: F401  (registration)
