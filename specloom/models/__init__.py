"""Target models in specloom's own PyTorch code. Importing this package registers every family (its model class
in `FAMILIES` and its record in `FAMILY_SPECS`); also the attention context (context.py), the CPU linear kernels
and the batch-invariant C kernels (cpu_packing.py, invariant_*.py, native.py).

May import: the floor it shares with loading/, kv, host/ and the other currencies, and errors / config below;
never drafters/, the step or anything above it."""

from . import gemma3, llama, llama_moe  # noqa: F401  (registration)
from .family import FAMILY_SPECS, FamilySpec, family_spec
from .transformer import FAMILIES, DecoderLM, ForwardOutput

__all__ = ["FAMILIES", "FAMILY_SPECS", "DecoderLM", "FamilySpec", "ForwardOutput", "family_spec"]
