"""Gemma-3 (text): sandwich norms (pre and post attention / MLP), q/k RMSNorm, embeddings scaled by sqrt(H),
GELU-tanh MLP, tied head, and sliding-window layers with their own (local) RoPE base. Which layers slide comes
from `config.layer_types` (every 6th layer is global in the released models)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .family import FamilySpec, register_family_spec, sqrt_hidden_embedding_scale
from .layers import Attention, AttentionContext, GatedMLP, RMSNorm
from .transformer import DecoderLM, register_family


class Gemma3Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@register_family("gemma3")
class Gemma3ForCausalLM(DecoderLM):
    block_cls = Gemma3Block


def _gguf_config(arch: str, get, cfg: dict) -> dict:
    """What a Gemma-3 GGUF header leaves implicit, as HF config.json keys."""
    return {
        "sliding_window": get("attention.sliding_window", 512),
        "sliding_window_pattern": get("attention.sliding_window_pattern", 6),
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": cfg["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


GEMMA3 = register_family_spec(FamilySpec(
    name="gemma3",
    model_cls=Gemma3ForCausalLM,
    model_types=("gemma3", "gemma3_text"),
    tie_word_embeddings=True,
    embedding_scale=sqrt_hidden_embedding_scale,
    qk_norm_model_types=frozenset({"gemma3", "gemma3_text"}),
    sliding_layers=True,
    default_sliding_window_pattern=6,
    default_rope_local_theta=10000.0,
    norm_weight_offset=1.0,  # RMSNorm multiplies by (1 + w)
    gguf_archs={"gemma3": "gemma3_text"},
    gguf_block_names={
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_config=_gguf_config,
))
