"""EAGLE drafters at inference: `eagle` (EAGLE-1 weights) and `eagle3`, as chains or EAGLE-2 dynamic trees.

Settings (`--speculative-config`): `model` (drafter checkpoint directory; omitted = the drafter bundled for the
target, if any), `num_speculative_tokens` (draft depth), `tree_width` (top-k expanded per depth; 1 = chain) and
`num_draft_tokens` (tree nodes kept after reranking; SGLang's `speculative_num_draft_tokens`).

Per step (drafters.md §2.3): the drafter KV first takes the target features of the newly committed positions
(row t = feature f_t + token x_{t+1}, position t); its last output h* scores the root's children. A chain then
feeds its own argmax (or sample, whose q travels in the tree) k-1 times. A dynamic tree keeps the top-`w`
children by cumulative log-probability at each depth, feeds only those `w` frontier nodes through the drafter
(each sees the committed prefix, its own tree ancestors and itself), and finally keeps the best
`num_draft_tokens` of all scored candidates (scores fall along a path, so parents are always kept). Tree rows
written to the drafter KV are dropped at the next step; only committed positions stay.

Tree candidates are chosen deterministically, so the tree carries no q: the verifier checks them as one-hot
drafts (= sampling y ~ p and matching candidates in order), which is exact under sampling too.
"""

from __future__ import annotations

import torch

from ..sampling import probs_from_logits
from ..tree import DraftTree
from .base import DraftContext, Drafter, register

DEFAULTS = {"eagle": (5, 1, None), "eagle3": (6, 6, 24)}  # depth, tree_width, num_draft_tokens (tuned values live in the checkpoint)


class EagleDrafter(Drafter):
    eagle3 = False

    def __init__(self, model, depth: int, width: int, num_nodes: int | None):
        self.model = model
        self.depth = depth
        self.width = width
        self.num_nodes = num_nodes or depth * width
        self.needs_hidden = tuple(model.config.feature_ids)
        self.kv = None
        self.stable = 0  # drafter KV rows for committed positions 0..stable-1
        self._feats: list[torch.Tensor] = []  # target features of positions stable.. not yet fed

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def check(cls, spec, target_config) -> None:
        from .checkpoint import find_drafter_dir, read_drafter_config

        path = find_drafter_dir(spec.model, cls.method, target_config)
        read_drafter_config(path, cls.method)

    @classmethod
    def create(cls, spec, target, tokenizer) -> "EagleDrafter":
        from .checkpoint import find_drafter_dir, load_drafter

        path = find_drafter_dir(spec.model, cls.method, target.config)
        model, meta = load_drafter(path, cls.method, target, tokenizer)
        d_depth, d_width, d_nodes = DEFAULTS[cls.method]
        depth = spec.num_speculative_tokens or meta.get("depth") or d_depth
        width = spec.tree_width or meta.get("tree_width") or d_width
        nodes = getattr(spec, "num_draft_tokens", None) or (meta.get("num_draft_tokens") if width > 1 else None)
        if width == 1:
            nodes = depth
        elif nodes is None:
            nodes = d_nodes or depth * width
        return cls(model, depth, width, nodes)

    @property
    def num_speculative_tokens(self) -> int:
        return self.depth

    def memory(self) -> dict:
        from .base import kv_bytes_per_1k, module_bytes

        c = self.model.config
        dt = self.kv.dtype if self.kv is not None else torch.float32
        return {"weights": module_bytes(self.model), "kv_per_1k_tokens": kv_bytes_per_1k(1, c.num_kv_heads, c.head_dim, dt)}

    # -- state -----------------------------------------------------------------------------------------------
    def _features(self, target_out, rows=None) -> torch.Tensor:
        f = torch.cat([target_out.hidden[c] for c in self.needs_hidden], dim=-1)[0]  # (T, F)
        return f if rows is None else f[rows]

    def prefill(self, ctx: DraftContext, target_out) -> None:
        n = len(ctx.tokens)
        if self.kv is None or self.kv.max_len < n + 4096:
            self.kv = self.model.new_kv(n + 4096)
        self.kv.reset()
        self.stable = 0
        self._feats = [self._features(target_out)]  # prefill captures every prompt position

    def on_verified(self, ctx: DraftContext, result, target_out) -> None:
        self._feats.append(self._features(target_out, torch.tensor(result.path)))

    @torch.inference_mode()
    def _catch_up(self, ctx: DraftContext) -> torch.Tensor:
        """Feed the committed positions the drafter has not seen; return h* (1, H), whose logits score the
        root's children."""
        n = len(ctx.tokens) - 1  # root position
        feats = torch.cat(self._feats)[None]  # (1, m, F): positions stable .. n-1
        self._feats = []
        m = feats.shape[1]
        if self.stable + m != n:
            raise RuntimeError(f"eagle drafter out of step: {self.stable} + {m} rows for root position {n}")
        dev = feats.device
        toks = torch.tensor([ctx.tokens[self.stable + 1:n + 1]], device=dev)
        pos = torch.arange(self.stable, n, device=dev)[None]
        self.kv.truncate(self.stable)
        if self.kv.max_len < n + self.num_nodes + self.depth + 64:
            self.kv = self.kv.grown(n + 4096)
        h = self.model(self.model.input_hidden(feats, toks), toks, pos, self.kv)
        self.kv.commit()
        self.stable = n
        return h[:, -1]

    def _row(self, h, tokens: list[int], depth: int, n: int, mask=None):
        """Append rows of draft depth `depth` (reading `tokens`, one per row of h) to the drafter KV."""
        dev = h.device
        t = torch.tensor([tokens], device=dev)
        pos = torch.full((1, len(tokens)), self._position(n, depth), device=dev)
        out = self.model(self.model.next_input(h[None], t), t, pos, self.kv, attn_mask=mask)
        self.kv.commit()
        return out[0]

    # -- proposing -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> DraftTree:
        root = ctx.tokens[-1]
        h = self._catch_up(ctx)
        if ctx.k <= 0:
            return DraftTree.chain(root, [])
        if self.width == 1:
            return self._chain(ctx, h)
        return self._tree(ctx, h)

    # -- hooks (MTP overrides them: one drafter layer and KV cache per depth) -----------------------------------
    def _kv(self, depth: int):
        """The drafter KV cache that rows of this draft depth are appended to."""
        return self.kv

    def _base(self, depth: int) -> int:
        """Committed rows in `_kv(depth)` (tree rows go after them and are dropped after proposing)."""
        return self.stable

    def _position(self, n: int, depth: int) -> int:
        """RoPE position of a depth-`depth` row (it reads the token drafted at depth `depth`); n = root position.
        EAGLE pairing: the feature of position t sits with token x_{t+1} at position t."""
        return n + depth - 1

    def _logits(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Draft-vocabulary logits of a depth-`depth` row's output (depth 0: the catch-up's last row)."""
        return self.model.draft_logits(h)

    def _drop_tree_rows(self) -> None:
        self.kv.truncate(self.stable)

    def _chain(self, ctx: DraftContext, h: torch.Tensor) -> DraftTree:
        m = self.model
        n = len(ctx.tokens) - 1
        drafts, qs = [], []
        for i in range(ctx.k):
            logits = self._logits(h, i)[0]
            if ctx.params.greedy:
                tok = int(m.to_target_ids(logits.argmax()))
            else:
                q = probs_from_logits(m.expand_logits(logits), ctx.params)
                tok = int(torch.multinomial(q, 1, generator=ctx.generator))
                qs.append(q)
            drafts.append(tok)
            if i + 1 < ctx.k:
                h = self._row(h, [tok], i + 1, n)
        self._drop_tree_rows()
        return DraftTree.chain(ctx.tokens[-1], drafts, torch.stack(qs) if qs else None)

    def _tree(self, ctx: DraftContext, h_star: torch.Tensor) -> DraftTree:
        m = self.model
        w = self.width
        n = len(ctx.tokens) - 1
        dev = h_star.device
        lp = torch.log_softmax(self._logits(h_star, 0)[0], -1)
        top = lp.topk(w)
        # candidates: target token id, cumulative log-prob score, parent candidate (-1 = root)
        cand_tok = m.to_target_ids(top.indices).tolist()
        cand_score = top.values.tolist()
        cand_parent = [-1] * w
        frontier = list(range(w))
        frontier_h = h_star.expand(w, -1)
        slot_of: dict[int, tuple[int, int]] = {}  # expanded candidate -> (its depth, its drafter KV slot)
        anc_slots: dict[int, list[tuple[int, int]]] = {c: [] for c in frontier}
        for depth in range(1, ctx.k):
            kv = self._kv(depth)
            start = kv.length
            T = len(frontier)
            mask = torch.zeros(T, start + T, dtype=torch.bool, device=dev)
            mask[:, :self._base(depth)] = True
            for r, c in enumerate(frontier):
                for d, s in anc_slots[c]:
                    if self._kv(d) is kv:  # ancestors cached in the same KV (all of them for EAGLE)
                        mask[r, s] = True
                mask[r, start + r] = True
                slot_of[c] = (depth, start + r)
            out = self._row(frontier_h, [cand_tok[c] for c in frontier], depth, n, mask)  # (T, H)
            lp = torch.log_softmax(self._logits(out, depth), -1)  # (T, V_d)
            ctop = lp.topk(w, dim=-1)
            scores = torch.tensor([cand_score[c] for c in frontier], device=dev)[:, None] + ctop.values  # (T, w)
            toks = m.to_target_ids(ctop.indices).tolist()
            first_new = len(cand_tok)
            flat_scores = scores.flatten()
            score_list = flat_scores.tolist()
            for r, c in enumerate(frontier):
                cand_tok.extend(toks[r])
                cand_score.extend(score_list[r * w:(r + 1) * w])
                cand_parent.extend([c] * w)
            if depth + 1 >= ctx.k:
                break
            sel = flat_scores.topk(min(w, flat_scores.numel())).indices.tolist()
            new_frontier = [first_new + s for s in sel]
            for c in new_frontier:
                p = cand_parent[c]
                anc_slots[c] = anc_slots[p] + [slot_of[p]]
            frontier_h = out[torch.tensor([s // w for s in sel], device=dev)]
            frontier = new_frontier
        self._drop_tree_rows()
        # rerank: the best num_nodes candidates (ties: lower id = the parent first), kept in id order
        budget = self.num_nodes if ctx.max_nodes is None else min(self.num_nodes, ctx.max_nodes)
        order = sorted(range(len(cand_tok)), key=lambda c: (-cand_score[c], c))[:budget]
        keep = sorted(order)
        node_of = {c: i + 1 for i, c in enumerate(keep)}
        tokens = [ctx.tokens[-1]] + [cand_tok[c] for c in keep]
        parents = [-1] + [0 if cand_parent[c] < 0 else node_of[cand_parent[c]] for c in keep]
        return DraftTree(tokens, parents)


@register("eagle")
class Eagle1Drafter(EagleDrafter):
    eagle3 = False


@register("eagle3")
class Eagle3Drafter(EagleDrafter):
    eagle3 = True

