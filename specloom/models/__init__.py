"""Target models in specloom's own PyTorch code. Importing this package registers every family (its model class
in `FAMILIES` and its record in `FAMILY_SPECS`)."""

from . import gemma3, llama, llama_moe  # noqa: F401  (registration)
from .family import FAMILY_SPECS, FamilySpec, family_spec
from .transformer import FAMILIES, DecoderLM, ForwardOutput

__all__ = ["FAMILIES", "FAMILY_SPECS", "DecoderLM", "FamilySpec", "ForwardOutput", "family_spec"]
