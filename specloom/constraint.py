"""The grammar-constraint hook of the step: what a constraint (one per request) must offer.

The step calls it at four points, so constrained output is exact under speculation with any drafter:

    forced(limit) -> tokens          (optional) the tokens the grammar forces next: the step drafts them for free
                                     (grammar jump-forward) in front of, and instead of, the drafter this step
    mask_row(logits (V,))            before the first token is sampled
    prune(tree) -> tree              drafts the grammar rejects are cut before verification
    mask(tree, logits (N, V))        every tree row masked with the grammar state after that row's own path
    advance(tokens)                  the state moves over emitted tokens only

`serving/grammar.py` implements it with llguidance; the core never imports that module.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .tree import DraftTree


@runtime_checkable
class Constraint(Protocol):
    def mask_row(self, logits: torch.Tensor) -> None: ...

    def forced(self, limit: int) -> list[int]: ...

    def prune(self, tree: DraftTree) -> DraftTree: ...

    def mask(self, tree: DraftTree, logits: torch.Tensor) -> None: ...

    def advance(self, tokens: list[int]) -> None: ...
