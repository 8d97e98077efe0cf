"""Llama family: Llama-2/3.x, Mistral, SmolLM2, Qwen2/2.5 (q/k/v biases), Qwen3 (q/k RMSNorm). Pre-norm blocks; the
block's MLP is an MoE MLP on the layers an MoE config makes sparse (the MoE families in llama_moe.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .family import FamilySpec, register_family_spec
from .layers import Attention, AttentionContext, RMSNorm
from .moe import mlp_for
from .transformer import DecoderLM, register_family


class LlamaBlock(nn.Module):
    fused_stack = True  # `forward` is what kernels/decoder_stack.c computes (models/fused_stack.py)

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp_for(config, layer)  # dense, or the MoE MLP where the config makes the layer sparse

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # submodules' forward called directly: no hooks are used on them, and nn.Module.__call__ costs ~2 us a
        # call, ~250 calls a decode step
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn.forward(self.input_layernorm.forward(x), ctx))
        return x + self.mlp.forward(h)


@register_family("llama")
class LlamaForCausalLM(DecoderLM):
    block_cls = LlamaBlock


LLAMA = register_family_spec(FamilySpec(
    name="llama",
    model_cls=LlamaForCausalLM,
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    qk_norm_model_types=frozenset({"qwen3"}),
    qkv_bias_model_types=frozenset({"qwen2"}),
    gguf_archs={"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},
    # llama.cpp permutes Llama's q/k rows for its interleaved RoPE; Qwen2/Qwen3 use NeoX RoPE and stay unpermuted
    gguf_permuted_qk_archs=frozenset({"llama"}),
    gguf_block_names={"ffn_norm": "post_attention_layernorm"},
))
