"""specloom: exact speculative decoding for real language models, in plain PyTorch.

    import specloom
    engine = specloom.load("smollm2-135m", dtype="bf16")
    result = engine.generate("Hello", chat=True, max_tokens=64)

The floors, top to bottom (each imports only its own floor and those below; tests/test_layers.py checks it):
cli/ -> bench/, serving/, jobs/, doctor, export, quantize/ -> engine, scheduler -> depth, cost, speculative ->
step -> drafters/ -> training/ (the toolkit) -> models/, loading/, kv, tree, verify, sampling, host/, ... ->
errors, atomic. ARCHITECTURE.md draws the map.
"""

from .engine import Engine, GenerationResult, load
from .errors import SpecloomError
from .sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "SpecloomError", "load"]
__version__ = "0.1.0"
