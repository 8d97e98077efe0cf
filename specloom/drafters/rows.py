"""What the batch-first drafters share about a call's rows: drawing one chain position for every row (`draw`),
chains from the drafts (`chains`), a row's companion store (`own_store`) and which rows may share one padded pass
(`fitting_groups`). A pass over any rows of a store is the store's own (`KVCache.begin(rows, sizes)`: it runs
over the rows' span, `p.spread` / `p.pick` in and out of it)."""

from __future__ import annotations

import torch

from ..sampling import coupled_token, probs_from_logits
from ..tree import DraftTree


def draw(ctxs, logits: torch.Tensor, take, drafts: list[list[int]], qs: list[list[torch.Tensor]],
         to_target=None, full_vocab=None) -> list[int]:
    """One chain position for every row: row b (where take[b]) appends its draft token from logits[b] -- the
    argmax under greedy; under the coupled rule argmax(log q + G_t) with the target's own noise for that sequence
    index (sampling.py: the draft is the token the target picks whenever q and p agree enough); else a sample
    from q = probs_from_logits(logits[b]) with the row's own generator (q kept for the verifier). Returns every
    row's token (rows not taking one get their argmax, to feed on)."""
    best = logits.argmax(-1)
    best = (best if to_target is None else to_target(best)).tolist()
    out = list(best)
    for b, c in enumerate(ctxs):
        if not take[b]:
            continue
        if c.params.greedy:
            tok = best[b]
        elif c.noise_seed is not None:  # coupled: no q needed (verification compares tokens)
            q = logits[b] if full_vocab is None else full_vocab(logits[b])
            tok = coupled_token(q, c.params, c.noise_seed, c.root_position + 1 + len(drafts[b]))
            if full_vocab is None and to_target is not None:
                tok = int(to_target(torch.tensor(tok)))
        else:
            q = probs_from_logits(logits[b] if full_vocab is None else full_vocab(logits[b]), c.params)
            tok = int(torch.multinomial(q, 1, generator=c.generator))
            qs[b].append(q)
        drafts[b].append(tok)
        out[b] = tok
    return out


def keep_best(ctxs, toks, scores, parents, valid, n_keep: list[int]) -> list[DraftTree]:
    """A tree drafter's rerank (EAGLE-2's; the block drafters' trees too), for all rows at once. toks, scores,
    parents, valid: (B, N) candidates (valid: not deeper than the row's k); row b keeps its best n_keep[b] valid candidates (ties: the lower id, which is the
    parent first), in id order, with kept parents renumbered as tree nodes (node 0 = the root). Scores fall
    along a path, so a kept candidate's parent is kept. One host read for all rows."""
    return kept_trees(ctxs, kept_nodes(toks, scores, parents, valid, n_keep), n_keep)


def kept_trees(ctxs, kept: torch.Tensor, n_keep: list[int]) -> list[DraftTree]:
    """The trees of `kept_nodes`' (2, B, n) tensor: its one host read."""
    tok_l, par_l = kept.tolist()
    return [DraftTree([c.tokens[-1], *tok_l[b][:n]], [-1, *par_l[b][:n]])
            for b, (c, n) in enumerate(zip(ctxs, n_keep))]


def kept_nodes(toks, scores, parents, valid, n_keep: list[int]) -> torch.Tensor:
    """`keep_best` on the device: (2, B, max(n_keep)) -- each row's kept tokens and their parents' tree nodes."""
    B, N = scores.shape
    dev = scores.device
    ids = torch.arange(N, device=dev)
    order = scores.masked_fill(~valid, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    rank_kept = ids[None] < small_tensor(n_keep, dev)[:, None]  # (B, N): rank r is kept
    keep = torch.zeros(B, N, dtype=torch.bool, device=dev).scatter_(1, order, rank_kept)
    node = keep.cumsum(-1)  # the tree node of each kept candidate: its 1-based rank in id order
    pnode = torch.where(parents < 0, 0, node.gather(1, parents.clamp(min=0)))
    kept = torch.where(keep, ids, N + ids).topk(max(n_keep), -1, largest=False).indices  # kept ids, ascending
    return torch.stack([toks.gather(1, kept), pnode.gather(1, kept)])


def small_tensor(values: list[int], dev) -> torch.Tensor:
    """A few host integers as a device tensor -- by fills where a CUDA graph is being captured (a copy from host
    memory cannot be captured), else by one copy."""
    dev = torch.device(dev)
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.cat([torch.full((1,), v, dtype=torch.long, device=dev) for v in values])
    return torch.tensor(values, device=dev)


def chains(ctxs, drafts: list[list[int]], qs: list[list[torch.Tensor]]) -> list[DraftTree]:
    return [DraftTree.chain(c.tokens[-1], d, torch.stack(q) if q else None) for c, d, q in zip(ctxs, drafts, qs)]


def own_store(ctx, key, make):
    """The drafter's companion store `key` of the target store the row lives in (made on first use)."""
    return ctx.kv.companion(key, make)


PAD_FREE = 16  # a pass at most this wide takes any row: a few padding slots cost less than another pass


def fitting_groups(ctxs, sizes: list[int], store) -> list[list[int]]:
    """Indices of `ctxs` in groups whose ragged pass fits the store and does not mostly compute padding: a pass
    pads every row of its span to the widest size, so a long catch-up (a prompt just prefilled, or a row back
    from many idle steps) must not share a pass with rows close to their capacity, nor with rows of a few
    positions when it is wider than PAD_FREE and more than twice theirs (16 rows x 64 slots for one row's 64
    missed positions: its own pass instead). Usually one group. (A group split off for padding is at most
    TREE_SLACK wide, so where its span holds a row of an earlier group, grown by that group's pass, it still
    fits: a row's length never passes its sequence's, and the store keeps TREE_SLACK slots beyond that.)"""
    from ..kv import TREE_SLACK

    groups: list[list[int]] = []
    for i in sorted(range(len(ctxs)), key=lambda i: -sizes[i]):
        for g in groups:
            rows = [ctxs[j].row for j in g] + [ctxs[i].row]
            T = sizes[g[0]]  # the widest (sizes are taken in decreasing order)
            if T > PAD_FREE and 2 * sizes[i] < T and sizes[i] <= TREE_SLACK:
                continue
            if all(store.lengths[r] + T <= store.max_len for r in range(min(rows), max(rows) + 1)):
                g.append(i)
                break
        else:
            groups.append([i])
    return [sorted(g) for g in groups]
