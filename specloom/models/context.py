"""The one attention context builder: which keys each query of a pass sees, read from the store's slots.

    ctx = attention_context(kv.begin(rows, sizes), positions (n, T), attn_mask, cos_sin, sliding_window)

A pass over n rows writes T new entries per row (kv.py). Every query sees its row's committed slots and the new
entries `attn_mask` allows:

* `attn_mask` None: causal over the new entries;
* `(T, R)` or `(n, T, R)` bool, True = attend, R >= T: the mask covers each row's *last R slots* up to the end of
  the pass (R == T: the new entries only; R > T also slots held before the pass, e.g. a drafter's tree rows of
  earlier depths, so sibling branches stay hidden); every slot before those R is visible.

Sliding-window layers (Gemma) also hide keys whose RoPE position (`slot_pos`) is `sliding_window` or more behind
the query. Fast paths keep the common passes mask-free: a decode step (T == 1, no mask, rows of equal length)
reads all keys (a sliding layer its last `window` slots), a first prefill chunk is plain causal attention.
"""

from __future__ import annotations

import torch


class AttentionContext:
    """What every layer of one forward pass shares: the pass its keys/values go through and which keys each
    query sees. `masks[kind]` is a bool mask `(n, 1, T, S)` (True = attend) or absent for "all keys";
    `windows[kind]` the number of trailing key slots to read (None = all); `causal` a plain causal pass;
    `invariant`: attention runs the batch-invariant CPU kernel (models/invariant_attention.py), so a position's
    result does not depend on the pass it is in."""

    def __init__(self, kv, cos_sin: dict, masks: dict, windows: dict, causal: bool, invariant: bool = False):
        self.kv = kv
        self.cos_sin = cos_sin
        self.masks = masks
        self.windows = windows
        self.causal = causal
        self.invariant = invariant


def attention_context(kv, positions: torch.Tensor, attn_mask: torch.Tensor | None, cos_sin: dict,
                      sliding_window: int | None = None, kinds=("full",), invariant: bool = False) -> AttentionContext:
    """`kv` a KVPass (kv.py); positions (n, T) the RoPE positions of the new entries (stored in the slots)."""
    n, T = positions.shape
    if (n, T) != (kv.n, kv.T):
        raise ValueError(f"positions {tuple(positions.shape)} for a pass of {kv.n} rows x {kv.T} tokens")
    kv.set_positions(positions)
    S = kv.S
    sliding = "sliding" in kinds
    masks: dict[str, torch.Tensor] = {}
    windows: dict[str, int | None] = {}
    if kv.uniform and attn_mask is None and T == 1:
        if sliding and S > sliding_window:  # a decode step: a sliding layer reads only its last `window` slots
            windows["sliding"] = sliding_window
        return AttentionContext(kv, cos_sin, masks, windows, False, invariant)
    if kv.uniform and kv.start == 0 and attn_mask is None and (not sliding or S <= sliding_window):
        return AttentionContext(kv, cos_sin, masks, windows, True, invariant)
    dev = positions.device
    new = torch.ones(T, T, dtype=torch.bool, device=dev).tril() if attn_mask is None else attn_mask.to(dev)
    new = new.expand(n, *new.shape[-2:]) if new.dim() == 2 else new
    R = new.shape[-1]
    if new.shape[-2] != T or R < T:
        raise ValueError(f"attn_mask {tuple(new.shape)} for {T} new tokens: expected (…, {T}, R >= {T})")
    if kv.uniform:
        if R > S:
            raise ValueError(f"attn_mask width {R}: the rows hold only {S} slots")
        full = torch.cat([torch.ones(n, T, S - R, dtype=torch.bool, device=dev), new], dim=-1) if R < S else new
    else:
        ends = torch.tensor(kv.starts, device=dev) + T  # (n,)
        keys = torch.arange(S, device=dev)
        # R columns of headroom: a padding row holding fewer than R slots has mask columns before its first slot
        full = torch.zeros(n, T, R + S, dtype=torch.bool, device=dev)
        full[:, :, R:] = keys[None, None, :] < (ends - R)[:, None, None]  # committed slots before the R
        cols = R + (ends - R)[:, None] + torch.arange(R, device=dev)  # (n, R), >= 0
        full.scatter_(2, cols[:, None, :].expand(n, T, R), new)
        full = full[:, :, R:]
    masks["full"] = full.unsqueeze(1)  # (n, 1, T, S)
    if sliding:
        near = (positions.unsqueeze(-1) - kv.slot_positions().unsqueeze(1)) < sliding_window  # (n, T, S)
        masks["sliding"] = masks["full"] & near.unsqueeze(1)
    return AttentionContext(kv, cos_sin, masks, windows, False, invariant)
