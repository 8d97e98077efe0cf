"""Repetition, frequency and presence penalties and logit bias, exact under speculation (OpenAI's and vLLM's
request fields; issue 38).

    apply(logits (N, V) in place, params, tree, prompt, output)

Row i of `logits` is the target's next-token logits after tree node i's path. Plain decoding penalises by the
tokens generated so far; a tree node must penalise by the tokens generated so far *plus the drafts on its own
path* (root excluded: it is already output) -- what plain decoding would have generated had those drafts been
accepted. So each node gets its own counts, verification sees exactly the logits plain decoding would, and the
output (greedy, or distributed as sampling from the processed target) is plain decoding's.

Per row, in vLLM's order: logit bias added (`logit_bias`, token id -> bias in [-100, 100]); the repetition
penalty r (HF / vLLM: over prompt and output tokens, a logit l > 0 divided by r, l <= 0 multiplied by r); then
l -= frequency * count + presence * [count > 0] over output tokens only (OpenAI's definition). Temperature,
top-k and top-p come after (sampling.py), as everywhere.
"""

from __future__ import annotations

from collections import Counter

import torch

from .errors import SpecloomError


def check_vocab(params, vocab: int) -> None:
    """One clear error for a logit_bias token id outside the vocabulary."""
    bad = [t for t, _ in params.logit_bias if t >= vocab]
    if bad:
        raise SpecloomError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab})")


def active(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias)


def _paths(tree) -> list[list[int]]:
    """Each node's draft tokens from the root's child down to the node itself (the root's: none)."""
    paths: list[list[int]] = [[]]
    for i in range(1, len(tree)):
        paths.append(paths[tree.parents[i]] + [tree.tokens[i]])
    return paths


def apply(logits: torch.Tensor, params, tree, prompt: list[int], output: list[int]) -> None:
    """Process `logits` (one row per node of `tree`, or one row with tree None) in place."""
    paths = _paths(tree) if tree is not None else [[]]
    if logits.shape[0] != len(paths):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(paths)} nodes")
    base = Counter(output)
    bias = dict(params.logit_bias)
    seen_prompt = set(prompt) if params.repetition_penalty != 1.0 else set()
    ids = sorted(seen_prompt | set(base) | {t for p in paths for t in p} | set(bias))
    if not ids:
        return
    col = {t: j for j, t in enumerate(ids)}
    n, u = len(paths), len(ids)
    counts = torch.zeros(n, u, dtype=torch.float32)
    if base:
        counts += torch.tensor([float(base.get(t, 0)) for t in ids])
    for i, p in enumerate(paths):
        for t in p:
            counts[i, col[t]] += 1
    dev = logits.device
    idx = torch.tensor(ids, device=dev)
    vals = logits.index_select(1, idx).float()
    counts = counts.to(dev)
    if bias:
        vals += torch.tensor([float(bias.get(t, 0.0)) for t in ids], device=dev)
    r = params.repetition_penalty
    if r != 1.0:
        hit = (counts > 0) | torch.tensor([t in seen_prompt for t in ids], device=dev)
        vals = torch.where(hit, torch.where(vals > 0, vals / r, vals * r), vals)
    if params.frequency_penalty:
        vals -= params.frequency_penalty * counts
    if params.presence_penalty:
        vals -= params.presence_penalty * (counts > 0).float()
    logits.index_copy_(1, idx, vals.to(logits.dtype))
