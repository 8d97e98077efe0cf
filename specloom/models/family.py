"""One record per model family: every fact that differs between families, in one place.

A family is one decoder-block implementation with one set of checkpoint conventions (`llama`:
Llama/Mistral/SmolLM2/Qwen2/Qwen3; `gemma3`; the MoE layouts `qwen3_moe`, `qwen2_moe`, `mixtral`, which run the
Llama block with an MoE MLP). Its module (`specloom/models/llama.py`, `gemma3.py`, `llama_moe.py`) defines or
reuses the model class and registers a `FamilySpec` next to it; the
config parser (`specloom/config.py`) and the loaders (`specloom/loading/weights.py`, `gguf_file.py`) read the
facts from the record instead of testing the family's name. Adding a family = a new module with its block, its
`DecoderLM` subclass and one `register_family_spec(FamilySpec(...))`, imported from `specloom/models/__init__.py`.

This module imports nothing from specloom, so that `specloom.config` can look records up (lazily) while the
model modules themselves import `specloom.config`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


def unit_embedding_scale(hidden_size: int) -> float:
    return 1.0


def sqrt_hidden_embedding_scale(hidden_size: int) -> float:
    """Gemma multiplies the embeddings by sqrt(hidden_size) before the first layer."""
    return math.sqrt(hidden_size)


def _frozen(m: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True, eq=False)
class FamilySpec:
    name: str  # the family (key of `FAMILIES`), also `ModelConfig.family`
    model_cls: type  # the `DecoderLM` subclass (its `block_cls` is the decoder block)
    model_types: tuple[str, ...]  # HF `model_type`s this family implements
    # -- config defaults and rules (HF config.json keys that may be absent) ----------------------------------------
    tie_word_embeddings: bool = False  # default when config.json does not say
    embedding_scale: Callable[[int], float] = unit_embedding_scale  # hidden_size -> factor on the embeddings
    qk_norm_model_types: frozenset[str] = frozenset()  # model types with RMSNorm over each head of q and k
    # model types whose attention has biases on q/k/v by default and never on o_proj (Qwen2); for the others
    # `attention_bias` (default off) puts biases on q/k/v *and* o_proj (Llama)
    qkv_bias_model_types: frozenset[str] = frozenset()
    sliding_layers: bool = False  # per-layer sliding/full attention (`layer_types`) with its own local RoPE base
    default_sliding_window_pattern: int = 6  # every n-th layer global when config.json has no `layer_types`
    default_rope_local_theta: float = 10000.0
    # -- weight conventions -------------------------------------------------------------------------------------
    # RMSNorm multiplies by (offset + w): Gemma stores w and multiplies by (1 + w). The HF loader folds the offset
    # into the weight; llama.cpp stores offset + w in GGUF, which the GGUF loader undoes to get HF's w.
    norm_weight_offset: float = 0.0
    # -- mixture of experts (specloom/moe_config.py, models/moe.py) ---------------------------------------------
    # None: a dense family (expert keys in its configs are not read); a mapping: its configs may declare experts,
    # with these values for the keys they leave out (Mixtral always renormalises the top-k weights)
    moe_defaults: Mapping[str, object] | None = None
    # (regex, replacement) applied in order to every HF tensor name (after the `model.` prefix is stripped), mapping
    # the family's checkpoint names onto the Llama-style names the loader knows (Mixtral's `block_sparse_moe.experts.
    # {e}.w1` -> `mlp.experts.{e}.gate_proj`)
    hf_renames: tuple[tuple[str, str], ...] = ()
    # -- GGUF ----------------------------------------------------------------------------------------------------
    gguf_archs: Mapping[str, str] = field(default_factory=dict)  # GGUF `general.architecture` -> HF model_type
    # architectures whose q/k rows llama.cpp's convert_hf_to_gguf permuted for its interleaved RoPE (undone)
    gguf_permuted_qk_archs: frozenset[str] = frozenset()
    gguf_block_names: Mapping[str, str] = field(default_factory=dict)  # `blk.N.<x>` -> HF block module (extra)
    # (arch, get(metadata key without the arch prefix, default), config so far) -> extra HF config keys
    gguf_config: Callable[[str, Callable, dict], dict] | None = None

    def __post_init__(self):
        object.__setattr__(self, "gguf_archs", _frozen(self.gguf_archs))
        object.__setattr__(self, "gguf_block_names", _frozen(self.gguf_block_names))
        if self.moe_defaults is not None:
            object.__setattr__(self, "moe_defaults", _frozen(self.moe_defaults))
        unknown = (set(self.qk_norm_model_types) | set(self.qkv_bias_model_types) | set(self.gguf_archs.values())) \
            - set(self.model_types)
        if unknown:
            raise ValueError(f"family {self.name!r}: model types {sorted(unknown)} are not in its model_types")
        if not set(self.gguf_permuted_qk_archs) <= set(self.gguf_archs):
            raise ValueError(f"family {self.name!r}: gguf_permuted_qk_archs must be among its gguf_archs")

    def __repr__(self) -> str:
        return f"FamilySpec({self.name!r}, model_types={self.model_types})"


FAMILY_SPECS: dict[str, FamilySpec] = {}


def register_family_spec(spec: FamilySpec) -> FamilySpec:
    """Register a family's record; a model type or GGUF architecture may belong to one family only."""
    for other in FAMILY_SPECS.values():
        if other.name == spec.name:
            continue
        clash = (set(other.model_types) & set(spec.model_types)) | (set(other.gguf_archs) & set(spec.gguf_archs))
        if clash:
            raise ValueError(f"family {spec.name!r}: {sorted(clash)} already belong to family {other.name!r}")
    FAMILY_SPECS[spec.name] = spec
    return spec


def _specs() -> dict[str, FamilySpec]:
    if not FAMILY_SPECS:  # the records register when their model modules are imported
        import specloom.models  # noqa: F401
    return FAMILY_SPECS


def family_spec(name: str) -> FamilySpec:
    return _specs()[name]


def spec_for_model_type(model_type: str) -> FamilySpec | None:
    """The family implementing a HF `model_type`, or None."""
    for spec in _specs().values():
        if model_type in spec.model_types:
            return spec
    return None


def spec_for_gguf_arch(arch: str) -> FamilySpec | None:
    """The family implementing a GGUF `general.architecture`, or None."""
    for spec in _specs().values():
        if arch in spec.gguf_archs:
            return spec
    return None


def supported_model_types() -> list[str]:
    return sorted(t for spec in _specs().values() for t in spec.model_types)


def supported_gguf_archs() -> list[str]:
    return [a for spec in _specs().values() for a in spec.gguf_archs]
