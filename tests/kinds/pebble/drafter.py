"""The pebble drafter: `pebble_repeat` copies of the root token."""

from __future__ import annotations

import torch

from ..base import DraftContext, Drafter, int_key, register
from ...tree import DraftTree


class PebbleNet(torch.nn.Module):
    def __init__(self, value: float = 0.0):
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor([value]))
        self.config = type("Config", (), {"num_drafts": 2})()


@register("pebble", {"pebble_repeat": int_key(1, 8)}, (".trainer",))
class PebbleDrafter(Drafter):
    def __init__(self, k: int, model: PebbleNet | None = None):
        self.k, self.model = k, model or PebbleNet()

    @classmethod
    def create(cls, spec, target, tokenizer) -> "PebbleDrafter":
        model = None
        if spec.model:
            from ..checkpoint import load_drafter

            model, _ = load_drafter(spec.model, "pebble", target, tokenizer)
        return cls(spec.num_speculative_tokens or spec.pebble_repeat or 2, model)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def propose_one(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.chain(ctx.tokens[-1], [ctx.tokens[-1]] * ctx.k)
