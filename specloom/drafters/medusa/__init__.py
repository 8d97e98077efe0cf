"""`medusa`: heads on the target's last hidden state (drafter.py: heads and drafter; format.py: Medusa v0.1 /
"version 2" checkpoints; trainer.py)."""

from . import format  # noqa: F401  (checkpoint format registration)
from .drafter import TOPK, MedusaDrafter, MedusaHeads  # noqa: F401
