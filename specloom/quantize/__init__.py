"""Writing quantized checkpoints (`specloom quantize`): round-to-nearest FP8 / MXFP4 / NVFP4 in the layouts their
producers write (rtn.py), which modules are quantized (select.py), the built-in drafters a target can carry
(builtin.py) and the checkpoint writer (checkpoint.py). The readers are specloom/loading/ (target) and
drafters/checkpoint.py (drafters). May import: drafters/, loading/, models/ and below; only cli/ imports it."""

from .checkpoint import quantize, quantize_drafter_dir
from .rtn import WRITERS

__all__ = ["WRITERS", "quantize", "quantize_drafter_dir"]
