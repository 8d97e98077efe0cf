"""Block drafters `dflash` and `dspark`: model.py (the network), drafter.py (one drafter pass per step for all
rows), format.py (z-lab, speculators, DeepSpec and built-in checkpoints), trainer.py."""

from . import format  # noqa: F401  (checkpoint format registration)
from .drafter import DFlashDrafter, DSparkDrafter, _declares_dspark  # noqa: F401
