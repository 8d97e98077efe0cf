"""Building blocks shared by every target family: RMSNorm, RoPE, gated MLP and attention over the KV cache.

Weights follow HF's layout (`Linear.weight` is `[out, in]`), except that q/k/v and gate/up are fused into one
Linear each (`qkv_proj`, `gate_up_proj`) so that a decode step makes fewer, larger matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, RopeScaling
from . import invariant_attention, layer_ops
from .context import AttentionContext


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32. `weight` is the effective multiplier (Gemma's 1 + w is folded
    in at load time)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layer_ops.usable(x):  # bf16 inference on a CPU: one C call (models/layer_ops.py)
            return layer_ops.rms_norm(x, self._w32(), self.eps)
        # One fused op; for bf16 it normalises and scales in fp32 and rounds once.
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)  # (mixed precision training)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + delta: the residual add and the next norm in one call where it can."""
        if layer_ops.usable(x) and delta.dtype == x.dtype and delta.shape == x.shape:
            return layer_ops.rms_norm(delta, self._w32(), self.eps, residual=x)
        h = x + delta
        return h, self(h)

    def _w32(self) -> torch.Tensor:
        """The weight in fp32 (the C norm's input), kept while the weight is unchanged."""
        w = self.weight
        key = (w.data_ptr(), layer_ops.version(w))
        cached = getattr(self, "_w32_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, w.detach().float().contiguous())
            self._w32_cache = cached
        return cached[1]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.factor == 1.0:
        return inv_freq
    # Llama-3.x: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rope(nn.Module):
    """cos/sin tables indexed by position (rotate-half convention, as HF). Tables are built on first use and grow
    on demand, so the module can be created on the meta device."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.cos_table: torch.Tensor | None = None
        self.sin_table: torch.Tensor | None = None

    def _build(self, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(max_len, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)  # (S, d/2)
        self.cos_table = torch.cat([freqs, freqs], dim=-1).cos().to(dtype)  # (S, d)
        sin = freqs.sin()
        self.sin_table = torch.cat([-sin, sin], dim=-1).to(dtype)  # sign of rotate_half folded in

    def _cover(self, need: int, dtype: torch.dtype, device: torch.device) -> None:
        """Tables of at least `need` positions in `dtype` on `device` (built anew, never shrinking, otherwise)."""
        table = self.cos_table
        if table is None or need > table.shape[0] or table.dtype != dtype or table.device != device:
            self._build(max(need, 4096, 0 if table is None else table.shape[0]), dtype, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, signed sin (B, T, 1, d) in `dtype` (broadcast over heads of (B, T, H, d)).
        One row of consecutive positions on the CPU outside autograd (a decode step, a chain, a prefill chunk)
        takes the tables' rows as a view: the same values, without two gathers (tens of us of a 6 ms SmolLM2
        step: its caches are cold after the weights' pass). Outside autograd only: a view of a table built in
        inference mode must never be saved for backward."""
        B, T = positions.shape
        if positions.device.type == "cpu" and B == 1 and 0 < T <= 4096 and not torch.is_grad_enabled():
            ps = positions[0].tolist()
            p0 = ps[0]
            if p0 >= 0 and all(b == a + 1 for a, b in zip(ps, ps[1:])):
                self._cover(p0 + T, dtype, positions.device)
                return self.cos_table[p0:p0 + T].view(1, T, 1, -1), self.sin_table[p0:p0 + T].view(1, T, 1, -1)
        self._cover(int(positions.max()) + 1, dtype, positions.device)
        return self.cos_table[positions].unsqueeze(2), self.sin_table[positions].unsqueeze(2)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` without growing the tables (no host read of the positions: a CUDA graph replays it); the
        tables must already cover the positions in `dtype` (models/graphs.py builds them first)."""
        if self.cos_table is None or self.cos_table.dtype != dtype or self.cos_table.device != positions.device:
            raise RuntimeError("RoPE tables not built for this dtype/device")
        return self.cos_table[positions].unsqueeze(2), self.sin_table[positions].unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, d) rotated by position (HF's rotate_half convention: element i pairs with i + d/2).
    rotate_half(x) * sin == roll(x, d/2) * signed_sin, with signed_sin = [-sin, sin]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `intermediate_size` defaults to the config's (an MoE expert has its own)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate = inter
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj.forward(x)
        if self.act is F.silu and layer_ops.usable(gu):  # one C call (what the fused decoder stack runs too)
            return self.down_proj.forward(layer_ops.silu_mul(gu))
        gate, up = gu.split(self.intermediate, dim=-1)
        return self.down_proj.forward(self.act(gate) * up)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.kind = "sliding" if config.is_sliding(layer) else "full"
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = config.attn_scale

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, H)
        H = self.n_heads
        qkv = self.qkv_proj.forward(x).view(B, T, H + 2 * self.n_kv, self.head_dim)
        qk, v = qkv.split((H + self.n_kv, self.n_kv), dim=2)  # (B, T, H + H_kv, d), (B, T, H_kv, d)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        cos, sin = ctx.cos_sin[self.kind]
        if self.q_norm is None and layer_ops.usable(qkv) and layer_ops.rope_(qkv, H + self.n_kv, cos, sin):
            pass  # q and k heads rotated in place, in the projection's output (one C call)
        else:
            qk = apply_rope(qk, cos, sin)  # q and k heads rotated in one go
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)  # (B, H, T, d), (B, H_kv, T, d)
        keys, values = ctx.kv.write(self.layer, k, v.transpose(1, 2))  # (B, H_kv, S, d)
        window = ctx.windows.get(self.kind)
        if window is not None:
            keys, values = keys[:, :, -window:], values[:, :, -window:]
        mask = ctx.masks.get(self.kind)
        if ctx.invariant and not (torch.is_grad_enabled() and q.requires_grad):  # inference only (no autograd)
            # (B, H, T, d) fp32, each query's bits independent of the pass
            out = invariant_attention.attend(q, keys, values, mask, self.scale)
            return self.o_proj.forward(out.transpose(1, 2).reshape(B, T, H * self.head_dim).to(x.dtype))
        out = F.scaled_dot_product_attention(
            q.to(keys.dtype), keys, values, attn_mask=mask, is_causal=ctx.causal and mask is None,
            scale=self.scale, enable_gqa=self.n_kv != self.n_heads,
        )  # (B, H, T, d) in the KV dtype
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.head_dim).to(x.dtype))
