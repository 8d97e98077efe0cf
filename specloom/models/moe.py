"""Mixture-of-experts MLP for the decoder block: a router picks `top_k` of `num_experts` SwiGLU experts per token,
their outputs are summed with the router's weights, plus an optional shared expert that every token runs.

    mlp.gate.weight                  [E, H]   router (plus `e_score_correction_bias` [E] for DeepSeek-V3 scoring)
    mlp.experts.{e}.gate_up_proj     [2I, H]  each expert a `GatedMLP` (gate and up fused as for dense layers)
    mlp.experts.{e}.down_proj        [H, I]
    mlp.shared_expert(s).*                    optional, a `GatedMLP` of its own size
    mlp.shared_expert_gate.weight    [1, H]   optional (Qwen2-MoE): the shared output times sigmoid(x . w)

Routing (`Router.forward`), in fp32 whatever the model's dtype (so that a bf16 model picks its experts from
unrounded scores):
* softmax (Mixtral, Qwen-MoE): p = softmax(x W^T); the top_k of p; renormalised to sum 1 when `norm_topk_prob`.
* sigmoid (DeepSeek-V3): s = sigmoid(x W^T); experts chosen by s + bias (the bias only steers the choice) among the
  `topk_group` best of `n_group` groups (a group's score: the sum of its best two); weights are s of the chosen
  experts, renormalised when `norm_topk_prob`.
Both then multiply by `routed_scaling_factor`.

The experts run batched per expert: the (token, slot) pairs are sorted by expert once, and each expert that any
token picked multiplies its rows in one matmul (index_select), whose weighted output is scattered back with
index_add in ascending expert order. No per-token Python; one host sync per layer (the per-expert counts).
Experts are plain `nn.Linear`s, so each one loads and runs through the weight-format registry like any dense
projection (loading/formats.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..moe_config import MoEConfig
from .layers import GatedMLP


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        if moe.score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> (weights (N, k) fp32, expert ids (N, k) int64)."""
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())  # (N, E)
        if m.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            weights, ids = scores.topk(m.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
            if m.n_group > 1:
                grouped = choice.view(-1, m.n_group, m.num_experts // m.n_group)
                best = grouped.topk(2, dim=-1).values.sum(-1).topk(m.topk_group, dim=-1).indices  # (N, topk_group)
                keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best, True)
                choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
            ids = choice.topk(m.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if m.scoring == "sigmoid" else 0.0))
        if m.routed_scaling_factor != 1.0:
            weights = weights * m.routed_scaling_factor
        return weights, ids


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        moe: MoEConfig = config.moe
        self.moe = moe
        self.gate = Router(config.hidden_size, moe)
        self.experts = nn.ModuleList(GatedMLP(config, moe.intermediate_size) for _ in range(moe.num_experts))
        self.shared_name = moe.shared_name if moe.shared_intermediate_size else None
        if self.shared_name:
            setattr(self, self.shared_name, GatedMLP(config, moe.shared_intermediate_size))
        self.shared_expert_gate = (nn.Linear(config.hidden_size, 1, bias=False) if moe.shared_expert_gate
                                   else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        weights, ids = self.gate(flat)  # (N, k)
        k = ids.shape[1]
        ids, weights = ids.flatten(), weights.flatten()
        order = ids.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens ascending within one
        rows = order // k
        w = weights[order][:, None]  # fp32: the weighted sum is rounded to the model's dtype once per expert
        counts = torch.bincount(ids, minlength=self.moe.num_experts).tolist()
        out = torch.zeros_like(flat)
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = rows[start:start + n]
                y = self.experts[e](flat.index_select(0, idx)) * w[start:start + n]
                out.index_add_(0, idx, y.to(out.dtype))
                start += n
        if self.shared_name:
            shared = getattr(self, self.shared_name)(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)


def mlp_for(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: the MoE MLP where the config makes that layer sparse, the dense gated MLP elsewhere."""
    moe = getattr(config, "moe", None)
    if moe is not None and moe.is_sparse(layer):
        return SparseMoE(config)
    return GatedMLP(config)
