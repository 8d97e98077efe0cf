"""`eagle` (EAGLE-1) and `eagle3`: model.py (the network, training and inference), drafter.py (chains, EAGLE-2
dynamic trees, batch-first), format.py (SafeAILab / official / speculators checkpoints), trainer.py."""

from . import format  # noqa: F401  (checkpoint format registration)
from .drafter import Eagle1Drafter, Eagle3Drafter, EagleDrafter  # noqa: F401
