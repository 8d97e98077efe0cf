"""EAGLE drafters at inference: `eagle` (EAGLE-1 weights) and `eagle3`, as chains or EAGLE-2 dynamic trees.

Settings (`--speculative-config`): `model` (drafter checkpoint directory; omitted = the drafter bundled for the
target, if any), `num_speculative_tokens` (draft depth), `tree_width` (top-k expanded per depth; 1 = chain) and
`num_draft_tokens` (tree nodes kept after reranking; SGLang's `speculative_num_draft_tokens`), `draft_vocab` /
`token_map` (FR-Spec's reduced draft vocabulary, `_reduce_vocab`).

Per step (drafters.md §2.3): the drafter KV first takes the target features of the newly committed positions
(row t = feature f_t + token x_{t+1}, position t); its last output h* scores the root's children. A chain then
feeds its own argmax (or sample, whose q travels in the tree) k-1 times. A dynamic tree keeps the top-`w`
children by cumulative log-probability at each depth, feeds only those `w` frontier nodes through the drafter
(each sees the committed prefix, its own tree ancestors and itself), and finally keeps the best
`num_draft_tokens` of all scored candidates (scores fall along a path, so parents are always kept). Tree rows
written to the drafter KV are dropped at the next step; only committed positions stay.

Cost (issue 13): all rows of a step draft together, one drafter pass per depth; candidates, frontiers, ancestor
masks and the rerank are tensor ops over (rows, candidates), read back once per step. On the CPU the expansion
stops as soon as no deeper candidate could make any row's tree (a child never scores above its parent), so the
trees are the full expansion's with fewer passes. q/k/v and gate/up run as one matmul each (model.py), and the
EAGLE-3 head covers the draft vocabulary only (`d2t`). The tree shape itself is chosen from measurements
(shape.py).

Tree candidates are chosen deterministically, so the tree carries no q: the verifier checks them as one-hot
drafts (= sampling y ~ p and matching candidates in order), which is exact under sampling too.
"""

from __future__ import annotations

import logging
import time

import torch

from ...host import last_level_cache_bytes
from ...models import fused_stack
from ...sampling import SamplingParams
from ...tree import DraftTree
from ..base import DraftContext, Drafter, TREE_KEYS, VOCAB_KEYS, path_rows, register
from ..rows import chains, draw, fitting_groups, keep_best, own_store, small_tensor

log = logging.getLogger("specloom")
DEFAULTS = {"eagle": (5, 1, None), "eagle3": (6, 6, 24)}  # depth, tree_width, num_draft_tokens (tuned values live in the checkpoint)


class Candidates:
    """One step's EAGLE-2 candidates for every row: (B, N) target tokens, cumulative log-prob scores and parent
    candidates (-1 = the root); `sizes[j]` candidates at depth `depths[j]` (ids grow with depth), `frontiers[j]`
    the (B, w) ids expanded from depth `depths[j]`, `passes` the drafter passes run after the catch-up."""

    __slots__ = ("tokens", "scores", "parents", "sizes", "depths", "frontiers", "passes")

    def __init__(self, tokens, scores, parents, sizes, depths, frontiers, passes):
        self.tokens, self.scores, self.parents = tokens, scores, parents
        self.sizes, self.depths, self.frontiers, self.passes = sizes, depths, frontiers, passes

    def depth_of(self) -> torch.Tensor:
        return torch.cat([torch.full((n,), d, device=self.tokens.device) for n, d in zip(self.sizes, self.depths)])

    def valid(self, ks: list[int]) -> torch.Tensor:
        """(B, N): candidate no deeper than its row's k."""
        return self.depth_of()[None] <= small_tensor(ks, self.tokens.device)[:, None]

    def n_keep(self, ks: list[int], budgets: list[int]) -> list[int]:
        return [min(b, sum(n for n, d in zip(self.sizes, self.depths) if d <= k)) for b, k in zip(budgets, ks)]


class ShapeTable:
    """A checkpoint's tree shapes with what does not depend on the host -- each shape's tau and drafter passes per
    step, measured on training prompts by scripts/choose_eagle_tree.py (`tree_choice.shapes`) -- and the drafting
    cost it measured in target steps (c = c0 + c1(width) x passes). `best(curve)` scores every shape with a host's
    verify-cost curve v(nodes + 1) as the chooser does, tau / (v + c), and keeps the checkpoint's own shape unless
    another predicts `MARGIN` more: the shape the bundled drafter was tuned with on one host (a 5-token pass at
    1.2 decode steps with AMX tiles) is not the best where a verification row costs more (1.57 steps on an
    AVX512-BF16 host without AMX: a depth-1 chain)."""

    MARGIN = 1.03
    SAME = 0.02  # scores this close to the best are one (the bundled table's top shapes: se_vs_best 0.013-0.021)

    def __init__(self, shapes: list, c0: float, c1: dict, now: tuple[int, int, int]):
        self.shapes, self.c0, self.c1, self.now = shapes, c0, c1, now
        self.tau_now = next((t for d, w, n, t, _ in shapes if (d, w, n) == now), None)

    @classmethod
    def from_meta(cls, meta: dict, now: tuple[int, int, int]) -> "ShapeTable | None":
        tc = meta.get("tree_choice") or {}
        shapes, costs = tc.get("shapes"), tc.get("costs") or {}
        if not shapes or "c0" not in costs or not costs.get("c1"):
            return None
        return cls([tuple(r) for r in shapes], float(costs["c0"]), {int(k): float(v) for k, v in costs["c1"].items()},
                   now)

    def best(self, curve, costs: tuple[float, dict] | None = None) -> tuple[int, int, int, float] | None:
        """The shape to draft with under `curve` and the drafting costs (c0, c1) timed on this host (None: the
        table's own); None to keep the checkpoint's."""
        step = curve(1, 1)
        if not step or step <= 0:
            return None
        c0, c1 = costs if costs is not None else (self.c0, self.c1)

        def predicted(d, w, n, tau, passes):
            return tau / (curve(1, n + 1) / step + c0 + c1[w] * passes)

        scored = [(predicted(*r), r) for r in self.shapes if r[1] in c1]
        if not scored:
            return None
        top = max(p for p, _ in scored)
        mine = next((p for p, q in scored if tuple(q[:3]) == self.now), None)
        if mine is not None and top < mine * self.MARGIN:
            return None
        # the cheapest shape predicted within SAME of the best, as the chooser takes the cheapest within one
        # standard error: the scores move with the curve and the timed costs from one load to the next (a
        # depth-2 two-node chain and the depth-1 chain swapped places by 1.5 %), the fewer nodes and passes less
        r = min((q for p, q in scored if p >= top / (1 + self.SAME)), key=lambda q: (q[2], q[4], q[0], -q[3]))
        return int(r[0]), int(r[1]), int(r[2]), float(r[3])


class _State:
    """Per row: target features of committed positions not yet fed to the drafter; the drafter rows committed
    before this step's tree rows (per store)."""

    __slots__ = ("feats", "base")

    def __init__(self):
        self.feats: list[torch.Tensor] = []
        self.base: list[int] = []


class EagleDrafter(Drafter):
    eagle3 = False
    keeps_kv = True
    # Idle steps are free: `on_verified` only keeps the target features of the committed positions (a gather),
    # and the next `_catch_up` feeds all of them to the drafter in one ragged pass (MTP: one per layer), so a
    # draft after any number of idle steps is the same as after none, for one pass over the missed positions.
    idle_free = True
    # Stop expanding a tree once no deeper candidate can enter it (the same trees, fewer passes). It costs one
    # host read per depth: free on the CPU, a stall of the queue on CUDA. None: on the CPU only.
    early_stop: bool | None = None

    def __init__(self, model, depth: int, width: int, num_nodes: int | None):
        self.model = model
        self.depth = depth
        self.width = width
        self.num_nodes = num_nodes or depth * width
        self.needs_hidden = tuple(model.config.feature_ids)
        model.stack_projections()  # q/k/v and gate/up as one matmul each while drafting

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
        cls._reduce_vocab(spec, meta, model, target, tokenizer, path)
        d_depth, d_width, d_nodes = DEFAULTS[cls.method]
        depth = spec.num_speculative_tokens or meta.get("depth") or d_depth
        width = spec.tree_width or meta.get("tree_width") or d_width
        nodes = getattr(spec, "num_draft_tokens", None) or (meta.get("num_draft_tokens") if width > 1 else None)
        if width == 1:
            nodes = depth
        elif nodes is None:
            nodes = d_nodes or depth * width
        d = cls(model, depth, width, nodes)
        d.checkpoint = {"path": path, "meta": meta}
        if not (spec.num_speculative_tokens or spec.tree_width or getattr(spec, "num_draft_tokens", None)):
            d.shape_table = ShapeTable.from_meta(meta, (depth, width, nodes))
        return d

    @staticmethod
    def _reduce_vocab(spec, meta, model, target, tokenizer, path) -> None:
        """FR-Spec's reduced draft vocabulary (`draft_vocab`, ranked by `token_map` or the bundled map; else the
        checkpoint's own `specloom.draft_vocab`): EAGLE-1 scores those rows of the target's head; EAGLE-3 keeps
        the most frequent `draft_vocab` rows of its own head (a size at least its vocabulary keeps them all)."""
        from ..token_map import ranked_rows, requested_size, use_requested_vocabulary

        if not model.config.eagle3:
            return use_requested_vocabulary(spec, meta, model, target, tokenizer, path)
        size = requested_size(spec, meta, path)
        ids = torch.arange(model.config.draft_vocab_size) + model.d2t.cpu()
        rows = ranked_rows(ids, size, spec.token_map, tokenizer, target.config.vocab_size) if size else None
        if rows is not None:
            model.keep_head_rows(rows)

    def fit_tree(self, curve) -> bool:
        """Re-choose the tree for this host's verify-cost curve (`curve(1, t)`: a t-token pass in decode steps;
        its `base` the seconds of one) and the drafting costs timed here (`drafting_costs`), once, where the
        request set no shape and the checkpoint carries a shape table. True if the shape changed (the prior tau
        then scaled to the new shape: `prior_tau`)."""
        table = getattr(self, "shape_table", None)
        if table is None:
            return False
        self.shape_table = None
        unit = getattr(curve, "base", None)
        costs = self.drafting_costs(unit, sorted(table.c1)) if unit else None
        best = table.best(curve, costs)
        if best is None or best[:3] == (self.depth, self.width, self.num_nodes):
            return False
        depth, width, nodes, tau = best
        measured = (self.checkpoint["meta"].get("measured") or {}).get("mean_accepted_length")
        if measured and table.tau_now and table.tau_now > 1:
            self.prior_tau = 1 + (measured - 1) * (tau - 1) / (table.tau_now - 1)
        self.depth, self.width, self.num_nodes = depth, width, depth if width == 1 else nodes
        return True

    @torch.inference_mode()
    def drafting_costs(self, unit_s: float, widths: list[int], depth: int = 4, samples: int = 5):
        """This host's drafting costs in units of `unit_s` (a target decode step), as the shape table prices them:
        c0 a depth-1 draft (the catch-up over the last step's two positions and the root's head), c1(w) each
        further tree depth of width w, from `propose` itself over random features after 128 cached positions
        (fastest of `samples`, kinds interleaved). The table's own costs were timed on another host with other
        code: there c0 was 0.34 target steps, on a 2-core EPYC after the one-call pass (`_one_call`) ~0.14.
        None where the drafter cannot run here (it then keeps the table's costs)."""
        m, dev = self.model, self.model.fc.weight.device
        if dev.type != "cpu" or not unit_s or unit_s <= 0:
            return None
        saved = self.depth, self.width, self.num_nodes, self.early_stop
        # stands in for the target's store: the prompt, two positions per timed draft, a tree's rows beyond
        host = m.new_kv(128 + 2 * (samples + 1) * (len(widths) + 1) + depth * max(widths, default=1) + 8)
        F = m.fc.in_features
        g = torch.Generator().manual_seed(0)
        vocab = m.config.vocab_size
        ctx = DraftContext(torch.randint(0, vocab, (129,), generator=g).tolist(), 100, SamplingParams(), None, 1,
                           kv=host, state=self.new_state())
        ctx.state.feats = [torch.randn(128, F, generator=g).to(m.dtype)]
        kinds = [(None, 1)] + [(w, w) for w in widths]
        times: dict = {k: [] for k, _ in kinds}
        flush = torch.empty(2 * last_level_cache_bytes(), dtype=torch.uint8)  # a target pass streams its weights
        # between two drafts: the drafter's own are not in cache then (timed warm, c0 read 0.09 against 0.135)
        try:
            self.early_stop = False
            self._catch_up([ctx])
            for s in range(samples + 1):
                for key, w in kinds[s % len(kinds):] + kinds[:s % len(kinds)]:
                    ctx.tokens += torch.randint(0, vocab, (2,), generator=g).tolist()
                    ctx.state.feats = [torch.randn(2, F, generator=g).to(m.dtype)]
                    ctx.k = self.depth = 1 if key is None else depth
                    self.width, self.num_nodes = w, (1 if key is None else w * depth)
                    flush.fill_(s)
                    t = time.perf_counter()
                    self.propose([ctx])
                    if s:  # the first round warms up
                        times[key].append(time.perf_counter() - t)
        except Exception:  # a drafter this harness cannot drive keeps the table's costs
            log.exception("timing the drafter's costs failed: the shape table's own are used")
            return None
        finally:
            self.depth, self.width, self.num_nodes, self.early_stop = saved
        c0 = min(times[None]) / unit_s
        return c0, {w: max(0.0, min(times[w]) / unit_s - c0) / (depth - 1) for w in widths}

    @property
    def num_speculative_tokens(self) -> int:
        return self.depth

    def memory(self) -> dict:
        from ..base import kv_bytes_per_1k, module_bytes

        c = self.model.config
        own_head = [self.model._shared["head"]] if self.model._shared.get("vocab") is not None else []
        return {"weights": module_bytes(self.model, *own_head),  # a reduced vocabulary's rows are a copy
                "kv_per_1k_tokens": kv_bytes_per_1k(1, c.num_kv_heads, c.head_dim,
                                                    self.model.new_kv(1, dtype=self.kv_cache_dtype).kv_type)}


    # -- state -----------------------------------------------------------------------------------------------
    def new_state(self) -> _State:
        return _State()

    def _stores(self, ctx) -> list:
        """The drafter's companion stores of the row's target store, one per drafter layer (EAGLE: one)."""
        return [own_store(ctx, self, lambda rows, n: self.model.new_kv(n, rows, dtype=self.kv_cache_dtype))]

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
        for b, (ctx, res) in enumerate(zip(ctxs, results)):
            ctx.state.feats.append(path_rows(f[b], res.path))

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
            M = max(m[i] for i in g)
            F = torch.zeros(len(g), M, feats[0].shape[-1], dtype=feats[0].dtype, device=dev)
            toks = torch.zeros(len(g), M, dtype=torch.long)
            pos = torch.zeros(len(g), M, dtype=torch.long)
            for j, i in enumerate(g):
                c, stable = ctxs[i], store.lengths[ctxs[i].row]
                F[j, :m[i]] = feats[i]
                toks[j, :m[i]] = torch.tensor(c.tokens[stable + 1:c.root_position + 1])
                pos[j] = torch.arange(stable, stable + M)
            p = store.begin([c.row for c in sub], [m[i] for i in g])
            sp_toks, sp_pos = p.spread(toks.to(dev)), p.spread(pos.to(dev))
            h = p.pick(self.model(self.model.input_hidden(p.spread(F), sp_toks), sp_toks, sp_pos, p))
            store.commit()
            for j, i in enumerate(g):
                out[i] = h[j, m[i] - 1]
        return torch.stack(out)

    def _one_call(self, c):
        """`_catch_up` for one row on a CPU as one C call (models/fused_stack.py `run_eagle3`), which also scores
        the root's children: (h* (1, H), its logits (V_d,) bf16, their argmax), the same bits as the layer-by-layer
        path; None where it cannot run (that path then runs)."""
        step = self.model.eagle_step() if c.kv.device.type == "cpu" else None
        if step is None:
            return None
        store = self._stores(c)[0]
        stable, feats = store.lengths[c.row], c.state.feats
        f = torch.cat(feats) if len(feats) > 1 else feats[0]
        m = f.shape[0]
        if stable + m != c.root_position:
            raise RuntimeError(f"eagle drafter out of step: {stable} + {m} rows for root position {c.root_position}")
        p = store.begin([c.row], [m])
        pos = torch.arange(stable, stable + m)[None]
        p.set_positions(pos)
        cos, sin = self.model.rope(pos, torch.bfloat16)
        out = fused_stack.run_eagle3(step, f.to(torch.bfloat16), torch.tensor(c.tokens[stable + 1:c.root_position + 1]),
                                     p, cos, sin)
        if out is None:
            return None  # (the uncommitted pass is dropped by the next `begin`; the features stay for `_catch_up`)
        store.commit()
        c.state.feats = []
        x, logits, best = out
        return x[-1:], logits, best

    def _first_draw(self, ctxs, h, first, drafts, qs) -> None:
        """Depth 1 of a chain: from `_one_call`'s logits and argmax where it ran (greedy: no further op)."""
        m = self.model
        if first is None:
            draw(ctxs, self._logits(h, 0), [0 < c.k for c in ctxs], drafts, qs, m.to_target_ids, m.expand_logits)
        elif ctxs[0].k > 0 and ctxs[0].params.greedy:
            b = int(first[2])
            drafts[0].append(b + int(m.d2t[b]))
        else:
            draw(ctxs, first[1].float()[None], [0 < c.k for c in ctxs], drafts, qs, m.to_target_ids, m.expand_logits)

    def _rows(self, h, tokens, depth: int, ctxs, mask=None):
        """Append T rows of draft depth `depth` per call row (h (B, T, H) the hidden they read, tokens (B, T))
        to the store of that depth; returns their outputs (B, T, H)."""
        store = self._stores(ctxs[0])[self._layer(depth)]
        if self._static is not None:  # inside a captured drafting step (graphed.py): one row, slots on the device
            T = tokens.shape[1]
            pos = self._position(self._static.root, depth).expand(1, T)
            return self.model(self.model.next_input(h, tokens), tokens, pos, self._static.pass_(store, ctxs[0].row, T),
                              attn_mask=mask)
        dev = h.device
        B, T = tokens.shape
        pos = torch.tensor([[self._position(c.root_position, depth)] * T for c in ctxs], device=dev)
        p = store.begin([c.row for c in ctxs], [T] * B)
        t = p.spread(tokens)
        out = self.model(self.model.next_input(p.spread(h), t), t, p.spread(pos), p,
                         attn_mask=None if mask is None else p.spread(mask, True))
        store.commit()
        return p.pick(out)

    # -- proposing -------------------------------------------------------------------------------------------
    graphable = False  # one row's tree step may replay as a CUDA graph (graphed.py): EAGLE-1/3, not MTP's hooks
    _static = None  # while a step is captured: its slots and root position on the device (graphed.py)

    @torch.inference_mode()
    def propose(self, ctxs) -> list[DraftTree]:
        if self.graphable and self.width > 1 and len(ctxs) == 1 and ctxs[0].kv.device.type == "cuda":
            from . import graphed

            trees = graphed.propose(self, ctxs[0])
            if trees is not None:
                return trees
        first = self._one_call(ctxs[0]) if len(ctxs) == 1 and self.eagle3 else None
        h = first[0] if first is not None else self._catch_up(ctxs)
        if h is None:
            return [DraftTree.chain(c.tokens[-1], []) for c in ctxs]
        for c in ctxs:
            c.state.base = [s.lengths[c.row] for s in self._stores(c)]
        try:
            if self.width == 1:
                return self._chain(ctxs, h, first)
            return self._tree(ctxs, h, first)
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

    def _chain(self, ctxs, h: torch.Tensor, first=None) -> list[DraftTree]:
        m = self.model
        K = max(c.k for c in ctxs)
        drafts = [[] for _ in ctxs]
        qs = [[] for _ in ctxs]
        for i in range(K):
            if i == 0:
                self._first_draw(ctxs, h, first, drafts, qs)
            else:
                draw(ctxs, self._logits(h, i), [i < c.k for c in ctxs], drafts, qs, m.to_target_ids, m.expand_logits)
            if i + 1 < K:
                toks = torch.tensor([[d[-1]] for d in drafts], device=h.device)
                h = self._rows(h[:, None], toks, i + 1, ctxs)[:, 0]
        return chains(ctxs, drafts, qs)

    def _tree(self, ctxs, h_star: torch.Tensor, first=None) -> list[DraftTree]:
        """EAGLE-2 for all rows at once: each depth expands every row's `w` frontier nodes in one drafter pass,
        then every row keeps its best candidates (`_expand`, `_select`)."""
        ks = [c.k for c in ctxs]
        budgets = [self.num_nodes if c.max_nodes is None else min(self.num_nodes, c.max_nodes) for c in ctxs]
        stop = self.early_stop if self.early_stop is not None else h_star.device.type == "cpu"
        cand = self._expand(ctxs, h_star, self.width, ks, budgets if stop else None,
                            None if first is None else first[1].float()[None])
        return self._select(ctxs, cand.tokens, cand.scores, cand.parents, cand.valid(ks), cand.n_keep(ks, budgets))

    def _expand(self, ctxs, h_star: torch.Tensor, w: int, ks: list[int], budgets: list[int] | None,
                logits0: torch.Tensor | None = None):
        """The EAGLE-2 candidates of every row, to depth max(ks): depth 1 = the top-w children of the root
        (scored by h*), then per depth one drafter pass over each row's w frontier nodes (the best w candidates
        of the previous depth), whose top-w children each are the next depth's candidates. Everything is a
        (B, ...) tensor: no Python per node. With `budgets` (the rows' node budgets) the expansion stops once no
        deeper candidate can enter any row's tree (`_settled`: the same trees, fewer passes; one host read per
        depth)."""
        m = self.model
        B, dev = len(ctxs), h_star.device
        K = max(ks)
        k_of = None if budgets is None else torch.tensor(ks, device=dev)
        budget = None if budgets is None else torch.tensor(budgets, device=dev)
        lp = torch.log_softmax(self._logits(h_star, 0) if logits0 is None else logits0, -1)  # (B, V_d)
        top = lp.topk(w, -1)
        toks, scores = [m.to_target_ids(top.indices)], [top.values]
        parents, depths = [torch.full((B, w), -1, device=dev)], [1]
        frontier = torch.arange(w, device=dev).expand(B, w)  # candidate ids of the frontier
        frontiers = [frontier]
        frontier_h = h_star[:, None].expand(B, w, h_star.shape[-1])
        anc = torch.zeros(B, w, 0, dtype=torch.bool, device=dev)  # frontier ancestors among this step's tree rows
        eye = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)
        layers = []  # the store of each depth's rows
        for depth in range(1, K):
            all_tok, all_score = torch.cat(toks, 1), torch.cat(scores, 1)
            if budget is not None and self._settled(all_score, frontier, k_of, budget, max(budgets), depth):
                break  # no deeper candidate could enter any row's tree: the remaining passes change nothing
            layer = self._layer(depth)
            same = [j for j, lay in enumerate(layers) if lay == layer]  # earlier depths cached in the same store
            cols = anc.view(B, w, len(layers), w)[:, :, same].reshape(B, w, len(same) * w)
            layers.append(layer)
            out = self._rows(frontier_h, all_tok.gather(1, frontier), depth, ctxs,
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
            frontiers.append(frontier)
        return Candidates(torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1),
                          [t.shape[1] for t in toks], depths, frontiers, len(layers))

    @staticmethod
    def _settled(scores, frontier, k_of, budget, bmax: int, depth: int) -> bool:
        """Whether expanding the frontier (depth `depth` -> `depth + 1`) could change no row's tree. A child's
        score is its parent's plus a log-probability <= 0, so no descendant of a frontier node f scores above
        f; it ties f at best and then ranks after it (ids grow with depth). If, in every row that may go
        deeper, `budget` candidates already score >= every frontier node, no descendant can make the rerank."""
        if scores.shape[1] < bmax:
            return False
        kth = scores.topk(bmax, -1).values.gather(1, (budget - 1)[:, None])[:, 0]  # each row's budget-th best
        best = scores.gather(1, frontier).max(-1).values
        return not bool(((k_of > depth) & (best > kth)).any())

    _select = staticmethod(keep_best)  # the rerank (rows.py), shared with the block drafters' trees


@register("eagle", {**TREE_KEYS, **VOCAB_KEYS}, (".trainer",),
          no_export="EAGLE-1 has no speculators kind (0.9.0 has eagle3); the EAGLE-1 directory specloom writes is the "
                    'layout vLLM reads with "method": "eagle"')
class Eagle1Drafter(EagleDrafter):
    eagle3 = False
    graphable = True


@register("eagle3", {**TREE_KEYS, **VOCAB_KEYS}, (".trainer",))
class Eagle3Drafter(EagleDrafter):
    eagle3 = True
    graphable = True

