"""The decoder-only target model: one `forward` for prefill, decode and tree verification.

    forward(tokens (B, T), positions (B, T), kv, attn_mask=None, capture=(), num_logits=None)
        -> ForwardOutput(logits (B, T', V) fp32, hidden {layer_id: (B, T, H)})

* The T new tokens are written to KV slots `[kv.length, kv.length + T)` (pending until `kv.commit`); their RoPE
  positions are `positions`, so tree nodes can share a depth-based position while owning distinct slots.
* `attn_mask` (T, T) or (B, T, T), bool, True = attend: which new tokens each new token sees (a draft tree's
  ancestor mask); every new token then sees the whole cached prefix. A mask of width `kv.length + T` instead
  covers the cached slots too (a drafter expanding a tree over several passes hides sibling branches it has
  cached). None means causal.
* `capture` uses the **HF `hidden_states` index** convention: id 0 is the embedding output (after Gemma's
  scaling), id k (1 <= k < L) is the output of decoder layer k-1 (= the input of layer k), and id L is the final
  hidden state *after* the final norm (HF's `hidden_states[-1]`). Negative ids count from L + 1 (so -1 = L).
* `num_logits` computes logits for the last n positions only (prefill needs 1); None = all T.

Families subclass `DecoderLM`, set `block_cls`, and register with `@register_family`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..config import ModelConfig
from ..kv import KVCache
from .layers import AttentionContext, RMSNorm, Rope

FAMILIES: dict[str, type["DecoderLM"]] = {}


def register_family(name: str):
    def deco(cls):
        FAMILIES[name] = cls
        return cls

    return deco


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # (B, T', V) fp32
    hidden: dict[int, torch.Tensor]  # capture id -> (B, T, H)


class DecoderLM(nn.Module):
    block_cls: type[nn.Module]

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.block_cls(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.ropes = nn.ModuleDict({"full": Rope(config.head_dim, config.rope_theta, config.rope_scaling)})
        if config.rope_local_theta is not None:
            self.ropes["sliding"] = Rope(config.head_dim, config.rope_local_theta)
        self.layer_kinds = {"sliding" if config.is_sliding(i) else "full" for i in range(config.num_layers)}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_kv(self, max_len: int, dtype: torch.dtype | None = None, batch: int = 1) -> KVCache:
        """A KV cache for this model. Default dtype: fp32 on CPU (attention over a few queries runs ~3x faster in
        fp32 than in bf16 there, and keys/values keep full precision), the model's dtype elsewhere."""
        c = self.config
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, dtype, self.device, batch)

    def _context(self, positions: torch.Tensor, kv: KVCache, attn_mask: torch.Tensor | None) -> AttentionContext:
        if hasattr(kv, "attention_context"):  # a pass over rows of a KVPool (continuous batching, kv_pool.py)
            return kv.attention_context(self, positions, attn_mask)
        B, T = positions.shape
        start = kv.reserve(T)
        S = start + T
        kv.slot_pos[:, start:S] = positions
        dtype = self.dtype
        cos_sin = {kind: self.ropes[kind if kind in self.ropes else "full"](positions, dtype) for kind in self.layer_kinds}
        window = self.config.sliding_window
        masks: dict[str, torch.Tensor | None] = {}
        windows: dict[str, int | None] = {}
        causal = False
        if T == 1 and attn_mask is None:
            # Decode step: the query sees every cached key; a sliding layer reads only its last `window` slots.
            if "sliding" in self.layer_kinds and S > window:
                windows["sliding"] = window
        elif start == 0 and attn_mask is None and ("sliding" not in self.layer_kinds or S <= window):
            causal = True
        else:
            dev = positions.device
            new = torch.ones(T, T, dtype=torch.bool, device=dev).tril() if attn_mask is None else attn_mask.to(dev)
            new = new.expand(B, *new.shape) if new.dim() == 2 else new
            if new.shape[-1] == T:
                new = torch.cat([torch.ones(B, T, start, dtype=torch.bool, device=dev), new], dim=-1)
            elif new.shape[-1] != S:
                raise ValueError(f"attn_mask width {new.shape[-1]}: expected {T} (new tokens) or {S} (all slots)")
            full = new.unsqueeze(1)  # (B, 1, T, S)
            masks["full"] = full
            if "sliding" in self.layer_kinds:
                kpos = kv.slot_pos[:, :S]  # (B, S): RoPE positions of the slots, new ones included
                near = (positions.unsqueeze(-1) - kpos.unsqueeze(1)) < window  # (B, T, S)
                masks["sliding"] = full & near.unsqueeze(1)
        return AttentionContext(kv, start, cos_sin, masks, windows, causal)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden (…, H) -> fp32 logits (…, V)."""
        out = self.lm_head(h).float()
        cap = self.config.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        attn_mask: torch.Tensor | None = None,
        capture: tuple[int, ...] = (),
        num_logits: int | None = None,
    ) -> ForwardOutput:
        L = self.config.num_layers
        if any(not -(L + 1) <= c <= L for c in capture):
            raise ValueError(f"capture ids must lie in [-{L + 1}, {L}] for a {L}-layer model, got {capture}")
        want = {c % (L + 1) for c in capture}
        ctx = self._context(positions, kv, attn_mask)
        x = self.embed(tokens)  # (B, T, H)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in want:
            hidden[0] = x
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx)
            if i + 1 in want and i + 1 < L:
                hidden[i + 1] = x
        if num_logits is not None and L not in want:
            x = x[:, -num_logits:]  # skip the norm and head on positions nobody reads
        x = self.norm(x)
        if L in want:
            hidden[L] = x
        if num_logits is not None:
            x = x[:, -num_logits:]
        hidden = {c: hidden[c % (L + 1)] for c in capture} if capture else hidden
        return ForwardOutput(self.logits(x), hidden)
