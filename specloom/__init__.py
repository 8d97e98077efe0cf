"""specloom: exact speculative decoding for real language models, in plain PyTorch.

    import specloom
    engine = specloom.load("smollm2-135m", dtype="bf16")
    result = engine.generate("Hello", chat=True, max_tokens=64)
"""

from .engine import Engine, GenerationResult, load
from .errors import SpecloomError
from .sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "SpecloomError", "load"]
__version__ = "0.1.0"
