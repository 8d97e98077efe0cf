"""Exact verification of a draft tree against the target's logits: a pure function, no model calls.

    verify(tree, target_logits (N, V), params, generator) -> VerifyResult

`target_logits[i]` is the target's next-token distribution after the path root..i (one verification pass over
the tree). Letters as in the papers: p = target, q = draft. Words as in vLLM: accepted (draft tokens kept),
recovered (drawn from the residual after a rejection), bonus (drawn from p when the deepest accepted node has no
child left to try).

* Greedy (temperature 0): descend while some child carries the target's argmax; then emit the argmax.
* Coupled sampling (`coupling`, sampling.py's "coupled" rule): the same walk with each node's token
  argmax(log p + G_t), G_t Gumbel noise keyed to the sequence index t; a draft is kept iff it equals it, so the
  text does not depend on the drafts at all.
* Sampling: walk from the root; at each accepted node try its children in order. Child x with draft
  distribution q (one-hot at x when the tree has no `draft_probs`) is accepted with probability
  min(1, p(x) / q(x)); on rejection p <- normalize(max(0, p - q)) and the next sibling is tried (SpecInfer's
  multi-draft rule; with each sibling's own conditional q it is recursive rejection sampling without
  replacement; with one-hot q it equals sampling y ~ p and checking the candidates in order). When no child is
  accepted the emitted token is drawn from the current p. A chain is the one-child case (Leviathan et al.).
  The output is distributed exactly as the target's own sampling.

p is always `probs_from_logits(target_logits[i], params)` — the same temperature / top-k / top-p that drafters
apply to q.

Random numbers: one uniform per tried child, in order, then one multinomial for the emitted token, all from
`generator` (which must live on the logits' device). Two implementations of the same rule:

* CPU (`_verify_sampling`): node by node, child by child, stopping at the first acceptance. Reading a value to the
  host costs nothing there.
* CUDA and any other accelerator (`_verify_sampling_batched`): no host synchronisation per node. p for every node
  comes from one `probs_from_logits` call; per tree level the uniforms of all the node's children are drawn in one
  call, the accept tests and residuals are computed on the device, and one `.tolist()` brings the accept flags
  back (then one more for the final multinomial). Its arithmetic is the CPU path's, operation for operation (the
  accept test `u * q(x) < p(x)` in float64, which is exact for fp32 operands, the residual renormalised by its
  fp32 sum, the fallback to p when the residual is empty). Uniforms drawn for children that were never tried
  (an earlier sibling was accepted) are discarded, so the result keeps its exact distribution; on the CPU (where
  the tests run it) the generator is then rewound so that only the tried children's uniforms are consumed, which
  makes both paths give the same tokens seed for seed. On CUDA a seeded run is reproducible but draws a different
  stream than a CPU run (as any CUDA sampling does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, argmax_ids, coupled_token, probs_from_logits
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
    best: list[int] | None = None,
    coupling: tuple[int, int] | None = None,
) -> VerifyResult:
    """`best`, for greedy rows: the argmax of each row of `target_logits`, when the caller computed it already
    (one argmax over all rows of a batched step). `coupling` = (noise seed, root position) for a request under
    the coupled rule (sampling.py): the node after path root..i chooses the token at sequence index root position
    + depth(i) + 1 by its position-keyed noise, and a draft is kept iff it equals that token."""
    if target_logits.shape[0] != len(tree):
        raise ValueError(f"{target_logits.shape[0]} rows of logits for a tree of {len(tree)} nodes")
    if params.greedy:
        return _verify_greedy(tree, target_logits, best)
    if coupling is not None:
        return _verify_coupled(tree, target_logits, params, *coupling)
    if generator is not None and generator.device.type != target_logits.device.type:
        raise ValueError(f"the sampling generator is on {generator.device} but the logits are on "
                         f"{target_logits.device}: create it with SamplingParams.generator(model.device)")
    if target_logits.device.type == "cpu":
        return _verify_sampling(tree, target_logits, params, generator)
    return _verify_sampling_batched(tree, target_logits, params, generator)


def _verify_greedy(tree: DraftTree, logits: torch.Tensor, best: list[int] | None = None) -> VerifyResult:
    if best is None:
        if len(tree) == 1:  # plain decoding: no drafts
            return VerifyResult([0], [argmax_ids(logits[0])], True)
        best = argmax_ids(logits)  # one pass over all nodes
    if len(tree) == 1:
        return VerifyResult([0], [best[0]], True)
    node, path = 0, [0]
    while True:
        want = best[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [want], not tree.children(node))
        node = nxt
        path.append(node)


def _verify_coupled(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, seed: int,
                    root_position: int) -> VerifyResult:
    """The greedy walk on position-keyed Gumbel-perturbed log-probabilities: at each node the target's token is
    `coupled_token` at its sequence index; descend to the child carrying it, else emit it."""
    node, path = 0, [0]
    while True:
        want = coupled_token(logits[node], params, seed, root_position + len(path))
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


def _verify_sampling_batched(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                             generator) -> VerifyResult:
    """`_verify_sampling` without a host synchronisation per node (see the module docstring): one sync per tree
    level for the accept flags, one for the emitted token."""
    dev = logits.device
    rewind = dev.type == "cpu"  # consume only the tried children's uniforms, as the CPU path does
    g = generator if generator is not None or not rewind else torch.default_generator
    probs = probs_from_logits(logits, params)  # (N, V): every node's p in one call
    dq = tree.draft_probs
    node, path = 0, [0]
    while True:
        p0 = probs[node]
        children = tree.children(node)
        if not children:
            tok = int(torch.multinomial(p0, 1, generator=g))
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [tok], True)
        n = len(children)
        state = g.get_state() if rewind and n > 1 else None
        u = torch.rand(n, generator=g, device=dev)  # the uniform of child i is u[i]
        p, accepts = p0, []
        for i, c in enumerate(children):
            x = tree.tokens[c]
            if dq is None:  # one-hot q: u * 1 < p(x)
                accepts.append(u[i] < p[x])
                p = p.clone()
                p[x] = 0.0
            else:
                qx = dq[c, x]
                accepts.append((qx > 0) & (u[i].double() * qx.double() < p[x].double()))
                p = (p - dq[c]).clamp_min(0.0)
            total = p.sum()
            # p <= q everywhere means p == q: a rejection had probability 0; keep p (as the CPU path does)
            p = torch.where(total <= 0.0, p0, p / total)
        flags = torch.stack(accepts).tolist()  # the one host sync of this level
        k = next((i for i, f in enumerate(flags) if f), None)
        if state is not None and k is not None and k + 1 < n:
            g.set_state(state)
            torch.rand(k + 1, generator=g, device=dev)  # the tried children's uniforms only
        if k is None:  # p is the residual after every child
            tok = int(torch.multinomial(p, 1, generator=g))
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [tok], False)
        node = children[k]
        path.append(node)
