"""Target models in specloom's own PyTorch code. Importing this package registers every family."""

from . import gemma3, llama  # noqa: F401  (registration)
from .transformer import FAMILIES, DecoderLM, ForwardOutput

__all__ = ["FAMILIES", "DecoderLM", "ForwardOutput"]
