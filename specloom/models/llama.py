"""Llama family: Llama-2/3.x, Mistral, SmolLM2, Qwen2/2.5 (q/k/v biases), Qwen3 (q/k RMSNorm). Pre-norm blocks."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import Attention, AttentionContext, GatedMLP, RMSNorm
from .transformer import DecoderLM, register_family


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@register_family("llama")
class LlamaForCausalLM(DecoderLM):
    block_cls = LlamaBlock
