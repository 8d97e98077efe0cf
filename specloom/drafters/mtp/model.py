"""DeepSeek-V3-style multi-token-prediction (MTP) layers: one definition for training and inference.

MTP module i (drafters.md §4.1), for a target of any family we run (its own decoder block class):

    e = target.embed(x)                                    # shared with the target
    u = eh_proj(cat[enorm(e), hnorm(h_prev)])              # Linear(2H, H, no bias), embedding first
    h = block(u)                                           # a decoder block shaped like the target's
    logits = target.lm_head(shared_head.norm(h))           # head shared with the target

Module 0 reads the target's final (post-norm) hidden state; module i > 0 reads module i-1's output h (pre-norm, as
vLLM and the DeepSeek reference feed it forward). Row t of module i pairs h^{i-1}_t with token x_{t+1+i}, sits at
RoPE position t and predicts x_{t+2+i} (teacher forcing in training; the drafter follows the same rows).

`forward` runs rows of one module over that module's own drafter KV cache (`new_kv`); `train_forward` runs all
modules over padded sequences with causal masks (DeepSeek's sequential MTP objective).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...kv import KVCache, default_kv_dtype
from ...models import FAMILIES
from ...models.cpu_packing import compute_dtype
from ...models.context import AttentionContext, attention_context
from ...models.layers import RMSNorm, Rope


class _SharedHead(nn.Module):
    def __init__(self, H: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(H, eps)  # `shared_head.norm`; `shared_head.head` is the target's lm_head


class MTPLayer(nn.Module):
    def __init__(self, config, index: int = 0):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        # built as decoder layer L + index (DeepSeek numbers MTP layers after the target's): an MoE config decides
        # by that number whether its MLP is a mixture of experts, as it does for the target's layers
        self.block = FAMILIES[config.family].block_cls(config, config.num_layers + index)
        attn = self.block.self_attn
        attn.kind, attn.layer = "full", 0  # full attention over the module's own single-layer KV cache
        self.shared_head = _SharedHead(H, eps)


class MTPModel(nn.Module):
    """`num_layers` MTP modules for a target with config `target_config` (ModelConfig)."""

    def __init__(self, target_config, num_layers: int):
        super().__init__()
        # Gemma's sliding layers and per-kind RoPE do not apply: each module attends to all its rows.
        self.config = dataclasses.replace(target_config, layer_types=(), sliding_window=None)
        self.layers = nn.ModuleList(MTPLayer(self.config, i) for i in range(num_layers))
        c = self.config
        self.rope = Rope(c.head_dim, c.rope_theta, c.rope_scaling)
        self._shared: dict = {"target": None}  # the target (embedding, head): shared, not owned

    def attach_target(self, target) -> None:
        self._shared = {"target": target}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self):
        return self.layers[0].eh_proj.weight.dtype

    @property
    def device(self):
        return self.layers[0].eh_proj.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._shared["target"].embed(tokens).to(self.dtype)

    def logits(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Module i's output (…, H) -> fp32 logits over the target vocabulary (through the target's head)."""
        t = self._shared["target"]
        head = self._shared.get("head")
        x = self.layers[i].shared_head.norm(h)
        if head is None:
            return t.logits(x.to(compute_dtype(t.lm_head)))
        return t.logits(x.to(compute_dtype(head)), head)

    def use_draft_vocab(self, ids: torch.Tensor, head: nn.Module) -> None:
        """Score only the target ids `ids` (sorted) through `head` (those rows of the target's head): FR-Spec's
        reduced draft vocabulary, as for EAGLE-1 (eagle/model.py)."""
        self._shared.update(vocab=ids, head=head)

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        return self._shared.get("vocab")

    def _input(self, i: int, h_prev: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        return layer.eh_proj(torch.cat([layer.enorm(self.embed(tokens)), layer.hnorm(h_prev.to(self.dtype))], -1))

    def forward(self, i: int, h_prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, kv,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of module i appended to its KV store `kv` (a store or a pass over some of its rows). h_prev
        (B, T, H); tokens, positions (B, T); attn_mask as for the target (models/context.py), None = causal.
        Returns the module's output h (B, T, H) (pre-norm)."""
        cos_sin = {"full": self.rope(positions, self.dtype)}
        ctx = attention_context(kv.open(tokens.shape[1]), positions, attn_mask, cos_sin)
        return self.layers[i].block(self._input(i, h_prev, tokens), ctx)

    def new_kv(self, max_len: int, batch: int = 1, dtype=None) -> KVCache:
        c = self.config
        dt = dtype or default_kv_dtype(self.device, self.dtype)
        return KVCache(1, c.num_kv_heads, c.head_dim, max_len, dt, self.device, batch)

    # -- training --------------------------------------------------------------------------------------------
    def train_forward(self, final: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor):
        """Teacher-forced MTP over a padded batch. final (B, T, H): the target's final hidden state at t;
        tokens (B, T); valid (B, T) bool. Yields (i, h_i) with h_i (B, T, H): module i's output at row t, which
        predicts x_{t+2+i}."""
        B, T = tokens.shape
        dev = tokens.device
        pos = torch.arange(T, device=dev)[None].expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :]
        mask = (mask | torch.eye(T, dtype=torch.bool, device=dev)[None])[:, None]  # (B, 1, T, T)
        h = final
        cos_sin = {"full": self.rope(pos, self.dtype)}
        for i in range(self.num_layers):
            shifted = torch.nn.functional.pad(tokens[:, 1 + i:], (0, 1 + i))  # x_{t+1+i}
            kv = self.new_kv(T, batch=B, dtype=torch.float32)
            ctx = AttentionContext(kv.open(T), cos_sin, {"full": mask}, {}, False)
            h = self.layers[i].block(self._input(i, h, shifted), ctx)
            yield i, h


def init_mtp(model: MTPModel, target=None, seed: int = 0, std: float = 0.02) -> None:
    """Random init (normal(std) matrices, unit norms); with `target`, each module's block and shared-head norm
    start from the target's last decoder layer and final norm (a common warm start for post-hoc MTP)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.zero_()
    if target is not None:
        from ...models.ggml_linear import dense_state

        last = dense_state(target.layers[-1])  # a target held as GGUF blocks: its weights dequantised
        for layer in model.layers:
            layer.block.load_state_dict({k: v.float() for k, v in last.items()})
            layer.shared_head.norm.weight.data.copy_(target.norm.weight.float())
