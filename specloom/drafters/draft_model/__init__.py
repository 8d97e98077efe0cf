"""`draft_model`: a separate small LM with the target's tokenizer (drafter.py; trainer.py distils one)."""

from .drafter import DraftModelDrafter  # noqa: F401  (registration)
