"""Warm starts shared by the drafter trainers: a draft layer begins as a copy of a target layer.

    first = start_layer(target, layer, n)              # --warm-start-layer checked: n target layers from `layer` on
    copy_layer(dst, src, input_norm, in_cols)          # attention, MLP (strongest neurons if narrower), norms
    pick_last_feature(fc, H)                           # fc: identity on the last target feature
"""

from __future__ import annotations

import torch

from ..errors import SpecloomError


def start_layer(target, layer: int, n: int = 1) -> int:
    """The index of the first of `n` consecutive target layers starting at `layer` (negative: from the end)."""
    L = len(target.layers)
    first = layer + L if layer < 0 else layer
    if not 0 <= first <= L - n:
        raise SpecloomError(f"--warm-start-layer must lie in [-{L}, {L - n}] for {n} draft layer(s) on this "
                            f"{L}-layer target, got {layer}")
    return first


@torch.no_grad()
def copy_layer(dst, src, input_norm, in_cols: slice = slice(None)) -> None:
    """Copy target decoder layer `src` into draft layer `dst`: q/k/v projections into their input columns
    `in_cols`, o_proj, the MLP (a narrower draft MLP keeps the target's neurons of largest ||down col|| * ||up
    row||, in order), the q/k norms where the target has them, `src`'s input norm into `input_norm` and the
    post-attention norm."""
    att, satt = dst.self_attn, src.self_attn
    q, k, v = satt.qkv_proj.weight.float().split(
        [att.q_proj.out_features, att.k_proj.out_features, att.v_proj.out_features], 0)
    for lin, w in ((att.q_proj, q), (att.k_proj, k), (att.v_proj, v)):
        lin.weight[:, in_cols] = w
    att.o_proj.weight.copy_(satt.o_proj.weight.float())
    g, u = src.mlp.gate_up_proj.weight.float().chunk(2, 0)
    down = src.mlp.down_proj.weight.float()
    keep = (down.norm(dim=0) * u.norm(dim=1)).topk(dst.mlp.gate_proj.out_features).indices.sort().values
    dst.mlp.gate_proj.weight.copy_(g[keep])
    dst.mlp.up_proj.weight.copy_(u[keep])
    dst.mlp.down_proj.weight.copy_(down[:, keep])
    if getattr(satt, "q_norm", None) is not None and getattr(att, "q_norm", None) is not None:
        att.q_norm.weight.copy_(satt.q_norm.weight.float())
        att.k_norm.weight.copy_(satt.k_norm.weight.float())
    input_norm.weight.copy_(src.input_layernorm.weight.float())
    dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())


@torch.no_grad()
def pick_last_feature(fc, H: int) -> None:
    """fc (H, n_features * H): identity on the last feature block, zero elsewhere."""
    fc.weight.zero_()
    fc.weight[:, -H:] = torch.eye(H)
