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

from ...tree import DraftTree
from ..base import DraftContext, Drafter, TREE_KEYS, register
from ..rows import Span, chains, draw, fitting_groups, own_store

DEFAULTS = {"eagle": (5, 1, None), "eagle3": (6, 6, 24)}  # depth, tree_width, num_draft_tokens (tuned values live in the checkpoint)


class _State:
    """Per row: target features of committed positions not yet fed to the drafter; the drafter rows committed
    before this step's tree rows (per store)."""

    __slots__ = ("feats", "base")

    def __init__(self):
        self.feats: list[torch.Tensor] = []
        self.base: list[int] = []


class EagleDrafter(Drafter):
    eagle3 = False

    def __init__(self, model, depth: int, width: int, num_nodes: int | None):
        self.model = model
        self.depth = depth
        self.width = width
        self.num_nodes = num_nodes or depth * width
        self.needs_hidden = tuple(model.config.feature_ids)

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def check(cls, spec, target_config) -> None:
        from ..checkpoint import find_drafter_dir, read_drafter_config

        path = find_drafter_dir(spec.model, cls.method, target_config)
        read_drafter_config(path, cls.method)

    @classmethod
    def create(cls, spec, target, tokenizer) -> "EagleDrafter":
        from ..checkpoint import find_drafter_dir, load_drafter

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
        from ..base import kv_bytes_per_1k, module_bytes

        c = self.model.config
        return {"weights": module_bytes(self.model),
                "kv_per_1k_tokens": kv_bytes_per_1k(1, c.num_kv_heads, c.head_dim, self.model.new_kv(1).dtype)}


    # -- state -----------------------------------------------------------------------------------------------
    def new_state(self) -> _State:
        return _State()

    def _stores(self, ctx) -> list:
        """The drafter's companion stores of the row's target store, one per drafter layer (EAGLE: one)."""
        return [own_store(ctx, self, lambda rows, n: self.model.new_kv(n, rows))]

    def _features(self, target_out) -> torch.Tensor:
        return torch.cat([target_out.hidden[c] for c in self.needs_hidden], dim=-1)  # (B, T, F)

    def prefill(self, ctx: DraftContext, target_out) -> None:
        for store in self._stores(ctx):
            store.truncate(0, row=ctx.row)
        ctx.state.feats = [self._features(target_out)[0]]  # prefill captures every prompt position
        self._reset(ctx)

    def _reset(self, ctx) -> None:
        pass

    def on_verified(self, ctxs, results, target_out) -> None:
        f = self._features(target_out)
        for ctx, res in zip(ctxs, results):
            ctx.state.feats.append(f[ctx.row, torch.tensor(res.path, device=f.device)])

    def _take_feats(self, ctxs) -> list[torch.Tensor]:
        feats = []
        for c in ctxs:
            feats.append(torch.cat(c.state.feats) if len(c.state.feats) > 1 else c.state.feats[0])
            c.state.feats = []
        return feats

    @torch.inference_mode()
    def _catch_up(self, ctxs) -> torch.Tensor:
        """Feed every row the committed positions the drafter has not seen (one ragged pass, or one per group
        of rows that fits the store); return h* (B, H), whose logits score each root's children."""
        store = self._stores(ctxs[0])[0]
        feats = self._take_feats(ctxs)
        m = [f.shape[0] for f in feats]
        for b, c in enumerate(ctxs):
            if store.lengths[c.row] + m[b] != c.root_position:
                raise RuntimeError(f"eagle drafter out of step: {store.lengths[c.row]} + {m[b]} rows for root "
                                   f"position {c.root_position}")
        dev = feats[0].device
        out = [None] * len(ctxs)
        for g in fitting_groups(ctxs, m, store):
            sub = [ctxs[i] for i in g]
            span, M = Span(sub), max(m[i] for i in g)
            F = torch.zeros(len(g), M, feats[0].shape[-1], dtype=feats[0].dtype, device=dev)
            toks = torch.zeros(len(g), M, dtype=torch.long)
            pos = torch.zeros(len(g), M, dtype=torch.long)
            for j, i in enumerate(g):
                c, stable = ctxs[i], store.lengths[ctxs[i].row]
                F[j, :m[i]] = feats[i]
                toks[j, :m[i]] = torch.tensor(c.tokens[stable + 1:c.root_position + 1])
                pos[j] = torch.arange(stable, stable + M)
            p = span.begin(store, [m[i] for i in g])
            sp_toks, sp_pos = span.spread(toks.to(dev)), span.spread(pos.to(dev))
            h = span.pick(self.model(self.model.input_hidden(span.spread(F), sp_toks), sp_toks, sp_pos, p))
            span.commit(store)
            for j, i in enumerate(g):
                out[i] = h[j, m[i] - 1]
        return torch.stack(out)

    def _rows(self, h, tokens, depth: int, ctxs, span, mask=None):
        """Append T rows of draft depth `depth` per call row (h (B, T, H) the hidden they read, tokens (B, T))
        to the store of that depth; returns their outputs (B, T, H)."""
        store = self._stores(ctxs[0])[self._layer(depth)]
        dev = h.device
        B, T = tokens.shape
        pos = torch.tensor([[self._position(c.root_position, depth)] * T for c in ctxs], device=dev)
        p = span.begin(store, [T] * B)
        t = span.spread(tokens)
        out = self.model(self.model.next_input(span.spread(h), t), t, span.spread(pos), p,
                         attn_mask=None if mask is None else span.spread(mask, True))
        span.commit(store)
        return span.pick(out)

    # -- proposing -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctxs) -> list[DraftTree]:
        h = self._catch_up(ctxs)
        if h is None:
            return [DraftTree.chain(c.tokens[-1], []) for c in ctxs]
        for c in ctxs:
            c.state.base = [s.lengths[c.row] for s in self._stores(c)]
        span = Span(ctxs)
        try:
            if self.width == 1:
                return self._chain(ctxs, h, span)
            return self._tree(ctxs, h, span)
        finally:
            for c in ctxs:  # tree rows are dropped: only committed positions stay
                for s, n in zip(self._stores(c), c.state.base):
                    s.truncate(n, row=c.row)

    # -- hooks (MTP overrides them: one drafter layer and KV store per depth) ----------------------------------
    def _layer(self, depth: int) -> int:
        """Which of `_stores` rows of this draft depth are appended to."""
        return 0

    def _position(self, n: int, depth: int) -> int:
        """RoPE position of a depth-`depth` row (it reads the token drafted at depth `depth`); n = root position.
        EAGLE pairing: the feature of position t sits with token x_{t+1} at position t."""
        return n + depth - 1

    def _logits(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Draft-vocabulary logits (N, V_d) of depth-`depth` outputs h (N, H) (depth 0: the catch-up's)."""
        return self.model.draft_logits(h)

    def _chain(self, ctxs, h: torch.Tensor, span) -> list[DraftTree]:
        m = self.model
        K = max(c.k for c in ctxs)
        drafts = [[] for _ in ctxs]
        qs = [[] for _ in ctxs]
        for i in range(K):
            draw(ctxs, self._logits(h, i), [i < c.k for c in ctxs], drafts, qs, m.to_target_ids, m.expand_logits)
            if i + 1 < K:
                toks = torch.tensor([[d[-1]] for d in drafts], device=h.device)
                h = self._rows(h[:, None], toks, i + 1, ctxs, span)[:, 0]
        return chains(ctxs, drafts, qs)

    def _tree(self, ctxs, h_star: torch.Tensor, span) -> list[DraftTree]:
        """EAGLE-2 for all rows at once: each depth expands every row's `w` frontier nodes in one drafter pass."""
        m, w = self.model, self.width
        B, dev = len(ctxs), h_star.device
        K = max(c.k for c in ctxs)
        lp = torch.log_softmax(self._logits(h_star, 0), -1)  # (B, V_d)
        top = lp.topk(w, -1)
        # candidates per row: target token, cumulative log-prob score, parent candidate (-1 = root), depth
        toks, scores = [m.to_target_ids(top.indices)], [top.values]
        parents, depths = [torch.full((B, w), -1, device=dev)], [1]
        frontier = torch.arange(w, device=dev).expand(B, w)  # candidate ids of the frontier
        frontier_h = h_star[:, None].expand(B, w, h_star.shape[-1])
        anc = torch.zeros(B, w, 0, dtype=torch.bool, device=dev)  # frontier ancestors among this step's tree rows
        eye = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)
        layers = []  # the store of each depth's rows
        for depth in range(1, K):
            layer = self._layer(depth)
            same = [j for j, lay in enumerate(layers) if lay == layer]  # earlier depths cached in the same store
            cols = anc.view(B, w, len(layers), w)[:, :, same].reshape(B, w, len(same) * w)
            layers.append(layer)
            all_tok, all_score = torch.cat(toks, 1), torch.cat(scores, 1)
            out = self._rows(frontier_h, all_tok.gather(1, frontier), depth, ctxs, span,
                             torch.cat([cols, eye], -1))  # (B, w, H)
            lp = torch.log_softmax(self._logits(out.reshape(B * w, -1), depth), -1).view(B, w, -1)
            ctop = lp.topk(w, dim=-1)  # (B, w, w)
            sc = all_score.gather(1, frontier)[..., None] + ctop.values
            first_new = all_tok.shape[1]
            toks.append(m.to_target_ids(ctop.indices).reshape(B, w * w))
            scores.append(sc.reshape(B, w * w))
            parents.append(frontier[..., None].expand(B, w, w).reshape(B, w * w))
            depths.append(depth + 1)
            if depth + 1 >= K:
                break
            sel = sc.reshape(B, w * w).topk(w, -1).indices  # (B, w)
            par = sel // w  # which frontier node each new frontier node hangs from
            anc = torch.cat([anc.gather(1, par[..., None].expand(B, w, anc.shape[-1])),
                             torch.nn.functional.one_hot(par, w).bool()], -1)
            frontier_h = out.gather(1, par[..., None].expand(B, w, out.shape[-1]))
            frontier = first_new + sel
        depth_of = [d for i, d in enumerate(depths) for _ in range(toks[i].shape[1])]
        tok_l, score_l, par_l = (torch.cat(x, 1).tolist() for x in (toks, scores, parents))
        trees = []
        for b, c in enumerate(ctxs):
            # rerank: the best num_nodes candidates (ties: lower id = the parent first), kept in id order
            budget = self.num_nodes if c.max_nodes is None else min(self.num_nodes, c.max_nodes)
            ids = [i for i in range(len(depth_of)) if depth_of[i] <= c.k]
            keep = sorted(sorted(ids, key=lambda i: (-score_l[b][i], i))[:budget])
            node_of = {i: j + 1 for j, i in enumerate(keep)}
            tokens = [c.tokens[-1]] + [tok_l[b][i] for i in keep]
            parent = [-1] + [0 if par_l[b][i] < 0 else node_of[par_l[b][i]] for i in keep]
            trees.append(DraftTree(tokens, parent))
        return trees


@register("eagle", TREE_KEYS, ("specloom.drafters.eagle.trainer",))
class Eagle1Drafter(EagleDrafter):
    eagle3 = False


@register("eagle3", TREE_KEYS, ("specloom.drafters.eagle.trainer",))
class Eagle3Drafter(EagleDrafter):
    eagle3 = True

