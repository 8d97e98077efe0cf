"""The decoder-only target model: one `forward` for prefill, decode and tree verification.

    forward(tokens (B, T), positions (B, T), kv, attn_mask=None, capture=(), num_logits=None)
        -> ForwardOutput(logits (B, T', V) fp32, hidden {layer_id: (B, T, H)})

* `kv` is a KV store (kv.py: every active row takes part) or a pass over some of its rows (`kv.begin(rows,
  sizes)`, ragged). Row b's T new entries go to its slots `[length_b, length_b + T)` (pending until
  `kv.commit`); their RoPE positions are `positions`, so tree nodes can share a depth-based position while owning
  distinct slots.
* `attn_mask` (T, R) or (B, T, R), bool, True = attend, R >= T: over each row's last R slots up to the end of the
  pass (R == T: which new tokens each new token sees, a draft tree's ancestor mask; R > T also covers slots held
  before the pass, so a drafter expanding a tree over several passes hides sibling branches it has cached); every
  earlier slot is visible. None means causal. One builder makes every mask: models/context.py.
* `capture` uses the **HF `hidden_states` index** convention: id 0 is the embedding output (after Gemma's
  scaling), id k (1 <= k < L) is the output of decoder layer k-1 (= the input of layer k), and id L is the final
  hidden state *after* the final norm (HF's `hidden_states[-1]`). Negative ids count from L + 1 (so -1 = L).
* `num_logits` computes logits for the last n positions only (prefill needs 1); None = all T; 0 = none (logits
  None: a caller that reads captured hidden states and applies a head itself).

Families subclass `DecoderLM`, set `block_cls`, and register with `@register_family`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..config import ModelConfig
from ..kv import KVCache, default_kv_dtype
from . import fused_stack
from .context import AttentionContext, attention_context
from .layers import RMSNorm, Rope

FAMILIES: dict[str, type["DecoderLM"]] = {}


def register_family(name: str):
    def deco(cls):
        FAMILIES[name] = cls
        return cls

    return deco


class ForwardOutput(NamedTuple):
    logits: torch.Tensor | None  # (B, T', V) fp32 (None with num_logits=0)
    hidden: dict[int, torch.Tensor]  # capture id -> (B, T, H)


class DecoderLM(nn.Module):
    block_cls: type[nn.Module]
    # attention through the batch-invariant CPU kernel (models/invariant_attention.py): every position's result is
    # then the same in a decode step, a verification pass or a prefill chunk. None: wherever it can run (a CPU
    # where it builds, a head size it supports); False: never (PyTorch's attention)
    invariant_attention: bool | None = None

    def uses_invariant_attention(self) -> bool:
        if self.invariant_attention is False or self.device.type != "cpu":
            return False
        from . import invariant_attention

        return invariant_attention.supports(self.config.head_dim) and invariant_attention.available()

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
        e = self.embed_tokens  # an nn.Embedding, or one held as shipped (models/ggml_linear.py: its `dtype`)
        return e.weight.dtype if isinstance(e, nn.Embedding) else e.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_kv(self, max_len: int, dtype: torch.dtype | None = None, batch: int = 1,
               active: int | None = None) -> KVCache:
        """A KV store for this model: `batch` rows of `max_len` slots (`active` 0: a pool whose rows are
        allocated). `dtype`: a torch dtype or a KV cache type (kv_quant.py: fp8_e4m3, fp8_e5m2, int8 keep codes
        and a scale per token and head). Default: fp32 on CPU (attention over a few queries runs ~3x faster in fp32
        than in bf16 there, and keys/values keep full precision), the model's dtype elsewhere."""
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, self.kv_dtype(dtype), self.device, batch,
                       active)

    def kv_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype:
        if dtype is not None:
            return dtype
        return default_kv_dtype(self.device, self.dtype)

    def _context(self, positions: torch.Tensor, kv, attn_mask: torch.Tensor | None) -> AttentionContext:
        kvp = kv.open(positions.shape[1])  # a store (every active row) or a pass over some of its rows
        if getattr(kvp, "static", False):  # a pass replayed as a CUDA graph (models/graphs.py): built on the device
            return kvp.static_context(self, positions, attn_mask)
        cos_sin = {kind: self.ropes[kind if kind in self.ropes else "full"](positions, self.dtype)
                   for kind in self.layer_kinds}
        return attention_context(kvp, positions, attn_mask, cos_sin, self.config.sliding_window, self.layer_kinds,
                                 self.uses_invariant_attention())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        return x

    def logits(self, h: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """Final-normed hidden (…, H) -> fp32 logits (…, V) through the LM head (or `head`: a subset of its rows)."""
        out = (self.lm_head if head is None else head)(h).float()
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
        fused = fused_stack.run(self, x, ctx, want)  # the layer loop in one C call, where it can run
        if fused is not None:
            x, more = fused
            hidden.update(more)
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, ctx)  # (no hooks on layers: nn.Module.__call__'s cost saved)
                if i + 1 in want and i + 1 < L:
                    hidden[i + 1] = x
        if num_logits is not None and L not in want:
            x = x[:, x.shape[1] - num_logits:]  # skip the norm and head on positions nobody reads
        x = self.norm(x)
        if L in want:
            hidden[L] = x
        if num_logits is not None:
            x = x[:, x.shape[1] - num_logits:]
        hidden = {c: hidden[c % (L + 1)] for c in capture} if capture else hidden
        return ForwardOutput(self.logits(x) if num_logits != 0 else None, hidden)
