"""Gemma-3 (text): sandwich norms (pre and post attention / MLP), q/k RMSNorm, embeddings scaled by sqrt(H),
GELU-tanh MLP, tied head, and sliding-window layers with their own (local) RoPE base. Which layers slide comes
from `config.layer_types` (every 6th layer is global in the released models)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
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
