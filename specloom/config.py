"""Target-model configuration: one frozen dataclass for every supported family.

`ModelConfig.from_hf(dict)` reads a HF `config.json`; the GGUF loader builds the same dict from GGUF metadata, so
both loaders share one parser. `family` selects the model class from the registry in `specloom.models`; what
differs between families (defaults, embedding scale, q/k norm, sliding layers) is read from the family's record,
`specloom.models.family.FamilySpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config_fields import check_attention_shape, config_dict, float_field, int_field, sub_dict
from .errors import SpecloomError
from .moe_config import MoEConfig, parse_moe

if TYPE_CHECKING:
    from .models.family import FamilySpec


def _spec_for(model_type: str | None) -> "FamilySpec | None":
    # imported here: the model modules import this one, and their import registers the records
    from .models.family import spec_for_model_type

    return spec_for_model_type(model_type)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.x frequency-dependent RoPE scaling (`rope_type: "llama3"`); `factor == 1` means none."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama with attention_bias)
    o_proj_bias: bool = False  # Llama with attention_bias also biases o_proj; Qwen2 does not
    qk_norm: bool = False  # Qwen3, Gemma-3: RMSNorm over each head of q and k
    hidden_act: str = "silu"
    # Gemma-3
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    rope_local_theta: float | None = None  # RoPE base of sliding layers
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    embedding_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (moe_config.py); None: every MLP dense
    # Where the target was read from when it is a HF directory (drafters built into the checkpoint -- MTP layers,
    # DSpark -- are read from there); None for GGUF files and models built in memory.
    source_dir: str | None = field(default=None, compare=False)

    @property
    def family(self) -> str:
        return self.family_spec.name

    @property
    def family_spec(self) -> "FamilySpec":
        spec = _spec_for(self.model_type)
        if spec is None:
            raise SpecloomError(f"unsupported architecture {self.model_type!r}")
        return spec

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Parse a HF `config.json` dict (also accepts multimodal wrappers holding a `text_config`). Every field
        is checked (type, a sanity bound, consistency) before anything is built: one SpecloomError naming it."""
        cfg = config_dict(cfg)
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            text = config_dict(cfg["text_config"], "model config field text_config")
            cfg = {**text, "model_type": text.get("model_type", cfg.get("model_type"))}
        model_type = cfg.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise SpecloomError(f"model config field model_type must be a string, got {model_type!r}")
        spec = _spec_for(model_type)
        if spec is None:
            from .models.family import supported_model_types

            raise SpecloomError(
                f"unsupported architecture {model_type!r}; specloom supports {', '.join(supported_model_types())}"
            )
        hidden = int_field(cfg, "hidden_size")
        heads = int_field(cfg, "num_attention_heads")
        layers = int_field(cfg, "num_hidden_layers")
        inter = int_field(cfg, "intermediate_size")
        vocab = int_field(cfg, "vocab_size")
        kv_heads = int_field(cfg, "num_key_value_heads", heads)
        given = cfg.get("head_dim") not in (None, 0)
        check_attention_shape(hidden, heads, kv_heads, given)
        head_dim = int_field(cfg, "head_dim") if given else hidden // heads
        rope = sub_dict(cfg, "rope_parameters") or sub_dict(cfg, "rope_scaling")
        rope_theta = float_field(cfg, "rope_theta", None)
        rope_local_theta = float_field(cfg, "rope_local_base_freq", None)
        if "full_attention" in rope:  # transformers >= 5 nests per layer type
            local = sub_dict(rope, "sliding_attention")
            rope_local_theta = float_field(local, "rope_theta", rope_local_theta, prefix="rope_parameters.")
            rope = sub_dict(rope, "full_attention")
        rope_theta = rope_theta or float_field(rope, "rope_theta", 10000.0, prefix="rope_parameters.")
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float_field(rope, "factor", prefix="rope_scaling."),
                low_freq_factor=float_field(rope, "low_freq_factor", 1.0, prefix="rope_scaling."),
                high_freq_factor=float_field(rope, "high_freq_factor", 4.0, prefix="rope_scaling."),
                original_max_position=int_field(rope, "original_max_position_embeddings", 8192,
                                                prefix="rope_scaling."),
            )
        elif rope_type not in ("default", None) and not (
                rope_type == "linear" and float_field(rope, "factor", 1.0, prefix="rope_scaling.") == 1):
            raise SpecloomError(f"unsupported RoPE scaling {rope_type!r} (supported: default, llama3)")

        layer_types: tuple[str, ...] = ()
        sliding = cfg.get("sliding_window")
        if spec.sliding_layers:
            if cfg.get("layer_types"):
                layer_types = tuple(cfg["layer_types"])
                known = ("full_attention", "sliding_attention")
                if len(layer_types) != layers or not all(t in known for t in layer_types):
                    raise SpecloomError(f"model config field layer_types must list {layers} entries, each one of "
                                        f"{', '.join(known)}")
            else:
                key = "sliding_window_pattern" if cfg.get("sliding_window_pattern") else "_sliding_window_pattern"
                pattern = int_field({"sliding_window_pattern": cfg.get(key)}, "sliding_window_pattern",
                                    spec.default_sliding_window_pattern)
                layer_types = tuple(
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
                )
            rope_local_theta = float(rope_local_theta or spec.default_rope_local_theta)
        elif cfg.get("use_sliding_window") and sliding:
            from .models.family import FAMILY_SPECS

            with_sliding = [s.name for s in FAMILY_SPECS.values() if s.sliding_layers]
            raise SpecloomError(
                f"sliding-window attention is not supported for {model_type!r} models "
                f"(only for the families {', '.join(with_sliding)})"
            )
        else:
            sliding = None
            rope_local_theta = None
        if cfg.get("attn_logit_softcapping"):
            raise SpecloomError("attention logit soft-capping (Gemma-2) is not supported")

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
            raise SpecloomError(f"model config field eos_token_id must be a token id or a list of them, got {eos!r}")
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float_field(cfg, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position=int_field(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", spec.tie_word_embeddings)),
            attention_bias=bool(cfg.get("attention_bias", model_type in spec.qkv_bias_model_types)),
            o_proj_bias=bool(cfg.get("attention_bias", False)) and model_type not in spec.qkv_bias_model_types,
            qk_norm=model_type in spec.qk_norm_model_types,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            sliding_window=int_field(cfg, "sliding_window") if sliding else None,
            layer_types=layer_types,
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=float_field(cfg, "query_pre_attn_scalar", None),
            embedding_scale=spec.embedding_scale(hidden),
            final_logit_softcapping=float_field(cfg, "final_logit_softcapping", None),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=parse_moe(cfg, spec.moe_defaults, layers, inter),
        )
