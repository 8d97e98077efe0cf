"""Exact verification of a draft tree against the target's logits: a pure function, no model calls.

    verify(tree, target_logits (N, V), params, generator) -> VerifyResult

`target_logits[i]` is the target's next-token distribution after the path root..i (one verification pass over
the tree). Letters as in the papers: p = target, q = draft. Words as in vLLM: accepted (draft tokens kept),
recovered (drawn from the residual after a rejection), bonus (drawn from p when the deepest accepted node has no
child left to try).

* Greedy (temperature 0): descend while some child carries the target's argmax; then emit the argmax.
* Sampling: walk from the root; at each accepted node try its children in order. Child x with draft
  distribution q (one-hot at x when the tree has no `draft_probs`) is accepted with probability
  min(1, p(x) / q(x)); on rejection p <- normalize(max(0, p - q)) and the next sibling is tried (SpecInfer's
  multi-draft rule; with each sibling's own conditional q it is recursive rejection sampling without
  replacement; with one-hot q it equals sampling y ~ p and checking the candidates in order). When no child is
  accepted the emitted token is drawn from the current p. A chain is the one-child case (Leviathan et al.).
  The output is distributed exactly as the target's own sampling.

p is always `probs_from_logits(target_logits[i], params)` — the same temperature / top-k / top-p that drafters
apply to q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, probs_from_logits
from .tree import DraftTree


@dataclass
class VerifyResult:
    path: list[int]  # accepted node indices, root first
    tokens: list[int]  # emitted: accepted draft tokens then one recovered or bonus token
    bonus: bool  # True when the last token was drawn at a node with no untried child (no rejection)

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    if target_logits.shape[0] != len(tree):
        raise ValueError(f"{target_logits.shape[0]} rows of logits for a tree of {len(tree)} nodes")
    if params.greedy:
        return _verify_greedy(tree, target_logits)
    return _verify_sampling(tree, target_logits, params, generator)


def _verify_greedy(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    if len(tree) == 1:  # plain decoding: no drafts
        return VerifyResult([0], [int(logits[0].argmax())], True)
    best = logits.argmax(-1).tolist()  # one pass over all nodes
    node, path = 0, [0]
    while True:
        want = best[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [want], not tree.children(node))
        node = nxt
        path.append(node)


def _verify_sampling(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator) -> VerifyResult:
    node, path = 0, [0]
    while True:
        p = probs_from_logits(logits[node], params)  # (V,)
        accepted = None
        children = tree.children(node)
        for c in children:
            x = tree.tokens[c]
            if tree.draft_probs is None:
                qx = 1.0
            else:
                q = tree.draft_probs[c]
                qx = float(q[x])
            px = float(p[x])
            u = float(torch.rand((), generator=generator))
            if qx > 0 and u * qx < px:  # u < min(1, p/q) without dividing
                accepted = c
                break
            # rejected: residual max(0, p - q), renormalised
            if tree.draft_probs is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - tree.draft_probs[c]).clamp_min_(0.0)
            total = float(p.sum())
            if total <= 0.0:  # p <= q everywhere means p == q: a rejection had probability 0
                p = probs_from_logits(logits[node], params)
            else:
                p = p / total
        if accepted is None:
            tok = int(torch.multinomial(p, 1, generator=generator))
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [tok], not children)
        node = accepted
        path.append(node)
