"""DraftTree: the one currency between drafters and the verifier.

Node 0 is the **root**: the last token already chosen but not yet run through the target (its KV is written by
the verification pass itself). Every other node is a drafted token; `parents[i] < i` for i > 0 and
`parents[0] == -1`. A chain is `parents = [-1, 0, 1, 2, ...]`.

`draft_probs[i]` (optional, `(N, V)`) is the distribution q that node i's token was actually drawn from, given
the path to its parent — after the same temperature / top-k / top-p as the target. Drafters that choose tokens
without a distribution (n-gram, argmax) leave it None: the verifier then treats each draft as a one-hot q.
Siblings drawn without replacement carry the conditional q of each draw (earlier siblings removed).

`score` (optional) is the drafter's own estimate of how many drafted tokens the target will accept (suffix
decoding: the sum of its nodes' empirical path probabilities); it never affects verification, only which of
two drafters' trees is verified (drafters/suffix/hybrid.py).

Depth, the ancestor mask, positions and root-to-leaf paths are derived from `parents`, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class DraftTree:
    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None  # (N, V) fp32, row 0 unused
    score: float | None = None  # expected accepted drafted tokens, by the drafter's own estimate (None: unknown)

    def __post_init__(self):
        n = len(self.tokens)
        if n == 0 or len(self.parents) != n or self.parents[0] != -1:
            raise ValueError("a DraftTree needs a root (parents[0] == -1) and one parent per token")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], 1)):
            raise ValueError(f"parents must satisfy 0 <= parents[i] < i: {self.parents}")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {n} nodes")

    @classmethod
    def chain(cls, root: int, drafts: list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """root followed by a chain of drafted tokens; draft_probs (len(drafts), V) for the drafted ones."""
        if draft_probs is not None:
            draft_probs = torch.cat([draft_probs.new_zeros(1, draft_probs.shape[-1]), draft_probs])
        return cls([root, *drafts], list(range(-1, len(drafts))), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depth(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(d)):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @cached_property
    def _children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], 1):
            kids[p].append(i)
        return kids

    def children(self, node: int) -> list[int]:
        return self._children[node]

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(N, N) bool: mask[i, j] = node j is node i or one of its ancestors (what node i may attend to)."""
        n = len(self.parents)
        m = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            m[i] |= m[self.parents[i]]
        return m.to(device)

    def positions(self, start: int) -> list[int]:
        """RoPE positions of the nodes when the root sits at position `start`."""
        return [start + d for d in self.depth]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths, in node order of the leaves."""
        out = []
        for leaf in range(len(self.parents)):
            if not self.children(leaf):
                path = [leaf]
                while self.parents[path[-1]] >= 0:
                    path.append(self.parents[path[-1]])
                out.append(path[::-1])
        return out
