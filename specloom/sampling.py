"""Sampling parameters and the one function that turns logits into the distribution we sample from.

`probs_from_logits` applies temperature, then top-k, then top-p (nucleus) and renormalises. Speculative
verification applies the very same function to the target's p and the drafter's q, so filtering can never make
the two disagree. Each request owns a `torch.Generator` seeded from its `seed`, so a seeded request is
reproducible whatever else runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpecloomError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise SpecloomError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecloomError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SpecloomError(f"top_k must be >= 0 (or -1 for off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) fp32 after temperature, top-k and top-p. Greedy -> one-hot."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits (V,) under `params` (argmax when greedy)."""
    if params.greedy:
        return int(logits.argmax())
    probs = probs_from_logits(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))
