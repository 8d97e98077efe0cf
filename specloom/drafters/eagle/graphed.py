"""An EAGLE tree step for one row replayed as a CUDA graph (issue 40): the catch-up pass over the m committed
positions the drafter has not seen, every depth's expansion pass and the rerank, captured once per (row, m,
depth cap, node budget) and replayed -- on a GPU a drafting step is ~100 small kernels, each launched from
Python, the same launch-bound cost as the target's (models/graphs.py). Only the kept tree is read back.

The step is the eager one (`EagleDrafter._expand`, `kept_nodes`): under capture `_rows` takes its slots and
positions from `_Static` (device tensors: the catch-up's first slot, the root position) instead of the store's
host bookkeeping, and the expansion runs to the depth cap (CUDA never stops early: that takes a host read per
depth). The host keeps the store's books: the catch-up's m rows committed, the tree rows dropped, as eagerly.
Anything else -- several rows, m > M_MAX, a chain (width 1), a quantized drafter store, the CPU -- drafts
eagerly. `SPECLOOM_CUDA_GRAPHS=0` turns it off with the target's graphs. On the CPU `propose(..., capture=False)`
runs the same static step eagerly (tests/test_graphs.py: the same trees as the eager step).
"""

from __future__ import annotations

import torch

from ...models.graphs import StaticPass, capture, enabled, prebuild_rope
from ..rows import kept_nodes, kept_trees

M_MAX = 8  # catch-up rows a replayed step takes (a longer catch-up, after idle steps, runs eagerly)
MAX_STEPS = 64  # captured shapes per store


class _Static:
    """The slots of a captured step's passes: the catch-up's first slot `start` (1,) and the root position
    `root` (1, 1), both device tensors; each expansion pass takes the next T slots after the catch-up's m."""

    def __init__(self, start: torch.Tensor, m: int, root: torch.Tensor):
        self.start, self.offset, self.root = start, m, root

    def pass_(self, store, row: int, T: int) -> StaticPass:
        p = StaticPass(store, row, T, self.start + self.offset)
        self.offset += T
        return p


class _Step:
    """One captured shape: input buffers, the graph and its (2, 1, n) kept-node output."""

    def __init__(self, drafter, ctx, store, m: int, k: int, budget: int):
        dev, F = store.device, sum(drafter.model.config.target_hidden_size for _ in drafter.needs_hidden)
        self.drafter, self.ctx, self.store, self.m, self.k, self.budget = drafter, ctx, store, m, k, budget
        self.feats = torch.zeros(1, m, F, dtype=drafter.model.dtype, device=dev)
        self.tok = torch.zeros(1, m, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, m, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.root = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.graph, self.out, self.n_keep, self.failed = None, None, None, False

    def run(self) -> torch.Tensor:
        """The step (what is captured): the catch-up pass, the expansion, the rerank on the device."""
        d, model = self.drafter, self.drafter.model
        p = StaticPass(self.store, self.ctx.row, self.m, self.start)
        h = model(model.input_hidden(self.feats, self.tok), self.tok, self.pos, p)[:, -1]  # h* (1, H)
        d._static = _Static(self.start, self.m, self.root)
        try:
            cand = d._expand([self.ctx], h, d.width, [self.k], None)
        finally:
            d._static = None
        self.n_keep = cand.n_keep([self.k], [self.budget])
        return kept_nodes(cand.tokens, cand.scores, cand.parents, cand.valid([self.k]), self.n_keep)

    def replay(self, capture_graphs: bool) -> torch.Tensor:
        """The step's output: replayed (captured on first use), or run eagerly (no capture here, or it failed)."""
        if not capture_graphs or self.failed:
            return self.run()
        if self.graph is None:
            pool = self.store.__dict__.get("_eagle_pool")
            if pool is None:
                pool = self.store.__dict__["_eagle_pool"] = torch.cuda.graph_pool_handle()
            captured = capture(self.run, pool, "EAGLE drafting steps of this shape")
            if captured is None:
                self.failed = True
                return self.run()
            self.graph, self.out = captured
        self.graph.replay()
        return self.out


def propose(drafter, ctx, capture_graphs: bool = True):
    """The row's draft tree from a replayed step, or None where this step drafts eagerly."""
    if capture_graphs and not enabled(ctx.kv):
        return None
    store = drafter._stores(ctx)[0]
    m = sum(f.shape[0] for f in ctx.state.feats)
    budget = drafter.num_nodes if ctx.max_nodes is None else min(drafter.num_nodes, ctx.max_nodes)
    stable = store.lengths[ctx.row]
    rows = m + drafter.width * max(ctx.k - 1, 0)  # the slots the catch-up and the expansion write
    if not 1 <= m <= M_MAX or ctx.k < 1 or store.k_scale is not None or stable + rows > store.max_len \
            or stable + m != ctx.root_position:
        return None
    steps = store.__dict__.setdefault("_eagle_steps", {})
    key = (id(drafter), drafter.width, ctx.row, m, ctx.k, budget)
    step = steps.get(key)
    if step is None:
        if len(steps) >= MAX_STEPS:
            return None
        step = steps[key] = _Step(drafter, ctx, store, m, ctx.k, budget)
    prebuild_rope(drafter.model.rope, store.max_len + 64, drafter.model.dtype, store.device)
    feats = drafter._take_feats([ctx])[0]
    step.feats.copy_(feats[None])
    step.tok.copy_(torch.tensor([ctx.tokens[stable + 1:ctx.root_position + 1]]))
    step.pos.copy_(torch.arange(stable, stable + m)[None])
    step.start.fill_(stable)
    step.root.fill_(ctx.root_position)
    out = step.replay(capture_graphs)
    store.begin([ctx.row], [m])  # the books: the catch-up's rows kept, the tree rows (written past them) dropped
    store.commit()
    return kept_trees([ctx], out, step.n_keep)
