"""Block drafters at inference: `dflash`, `dflash2` and `dspark` (drafters.md §5.2, §5.4, §6.1). One drafter pass
per step.

Per step: the drafter KV takes the context keys/values of the newly committed positions (the prefill's prompt
positions, then the rows `result.path` of each verification pass); the block [root, MASK ...] at positions
n .. n+B-1 (n = the root's position) runs once over that context; its slots give the drafts, a chain:

* DFlash: slots 1..B-1 (slot p predicts position n+p), each the argmax / a sample of its own distribution;
  `num_speculative_tokens` defaults to B-1 and may be lower, never higher.
* DFlash 2: as DFlash, through its convs; then, left to right, the candidate selector rescores each slot's top-k
  with the token chosen before it (the root at the first) and the draft is the argmax / a sample of those k
  scores (inverse CDF over the candidates, `draw`), q = softmax over them (zero elsewhere): the distribution it
  was drawn from, so verification stays exact.
* DSpark: slots 0..B-1 (slot p predicts position n+p+1), left to right, each slot's logits plus the Markov bias
  of the token chosen before it (slot 0: the root), q = that corrected distribution. `num_speculative_tokens`
  must be B: the slots are one trained block. With a confidence head and `confidence_threshold` > 0 the chain
  stops before the first slot whose confidence (computed from the slot and the previous choice, before the slot's
  own token is drawn) is below the threshold -- which tokens get verified never depends on the token itself, so
  the output stays exact; only verification decides what is kept.

Trees (`tree_width` w > 1; DDTree / JetSpec / SGLang's DFlash tree verify): the same single drafter pass, then a
beam over the slots: depth 1 keeps the top-w tokens of the first drafted slot, each deeper slot expands every one of
the w best nodes of the depth above with its top-w tokens (DSpark / DFlash 2: the slot's logits given that node's
token -- its Markov bias, or the selector's rescoring), scored by the path's joint log-probability; the best
`num_draft_tokens` candidates make the tree (`rows.keep_best`, EAGLE-2's rerank; the depth policy may ask for
fewer). The candidates are chosen deterministically, so the tree carries no q and verification checks them as
one-hot drafts -- exact under sampling as under greedy. A confidence cut is a chain's (refused with a tree).

Settings: `model` (checkpoint directory; DFlash omitted = the drafter bundled for the target; DSpark omitted = the
one built into the target checkpoint, else an overlay bundled for the target), `num_speculative_tokens`,
`confidence_threshold` (dspark; default the checkpoint's `confidence_threshold`, else off), `tree_width` and
`num_draft_tokens` (trees; default a chain).
"""

from __future__ import annotations

import os

import torch

from ...config_fields import float_field, int_field
from ...errors import SpecloomError
from ...tree import DraftTree
from ..base import TREE_KEYS, VOCAB_KEYS, DraftContext, Drafter, float_key, path_rows, register
from ...kv import RowSpan
from ..rows import chains, draw, fitting_groups, keep_best, own_store


def _declares_dspark(raw: dict) -> bool:
    return "dspark_block_size" in raw


class BlockDrafter(Drafter):
    keeps_kv = True
    # Idle steps are free: `on_verified` keeps the committed positions' features, the next `_catch_up` extends
    # the drafter KV over all of them in one ragged pass.
    idle_free = True

    def __init__(self, model, k: int, threshold: float, width: int = 1, nodes: int | None = None):
        self.model = model
        self.k = k
        self.threshold = threshold
        self.width = width  # > 1: a tree from the slots' top-w (see the module's docstring)
        self.num_nodes = (nodes or min(k * width, 4 * k)) if width > 1 else None
        self.needs_hidden = tuple(model.config.feature_ids)

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def find(cls, spec, target_config) -> str:
        from ..checkpoint import find_drafter_dir

        return find_drafter_dir(spec.model, cls.method, target_config)

    @classmethod
    def _settings(cls, spec, cfg, meta, path) -> tuple[int, float, int, int | None]:
        """(drafts per step, confidence threshold, tree width, tree nodes) from the settings and the checkpoint
        (its `specloom` block may carry a default tree: `tree_width`, `num_draft_tokens`, as EAGLE's does; a
        confidence threshold the request sets asks for a chain instead); SpecloomError if bad."""
        n = cfg.num_drafts
        k = spec.num_speculative_tokens
        if k is not None and k > n:
            raise SpecloomError(
                f"{path}: this {cls.method} drafter has a block of {cfg.block_size} and drafts at most {n} tokens "
                f"per pass; num_speculative_tokens={k} is too many (omit it or use 1..{n})")
        th = spec.confidence_threshold
        if th is not None and th > 0 and not cfg.confidence_head:
            raise SpecloomError(f"{path}: confidence_threshold needs a drafter with a confidence head; this "
                                f"{cls.method} checkpoint has none")
        what = f"{path}: {cls.method} drafter config"
        own_width = int_field(meta, "tree_width", 1, prefix="specloom.", what=what, bound="draft_depth")
        own_nodes = int_field(meta, "num_draft_tokens", None, prefix="specloom.", what=what, bound="draft_depth")
        if th is None:
            th = float_field(meta, "confidence_threshold", 0.0, positive=False, prefix="specloom.",
                             what=what) if cfg.confidence_head else 0.0
        if th > 0:
            own_width = 1  # a confidence cut (the request's, or the checkpoint's own) drafts a chain
        asked = getattr(spec, "tree_width", None)
        width = asked or own_width
        if width > 1 and th > 0:
            raise SpecloomError(f"{path}: confidence_threshold cuts a chain; with tree_width {width} the tree's node "
                                "budget (num_draft_tokens) bounds the drafts instead -- set confidence_threshold 0 "
                                "or tree_width 1")
        nodes = getattr(spec, "num_draft_tokens", None)
        if nodes and width == 1:
            raise SpecloomError(f"{path}: num_draft_tokens sizes a tree; give tree_width > 1 with it (a chain drafts "
                                "num_speculative_tokens)")
        if not nodes and not asked and width > 1:
            nodes = own_nodes  # the checkpoint's own tree, whole
        return k or n, th, width, nodes

    @classmethod
    def _resolve(cls, spec, target_config):
        from .format import block_config, meta_of
        from ..checkpoint import _load_json

        path = cls.find(spec, target_config)
        raw = _load_json(os.path.join(path, "config.json"))
        cfg = block_config(path, raw, target_config, cls.method)
        return path, raw, cfg, meta_of(raw)

    @classmethod
    def check(cls, spec, target_config) -> None:
        path, raw, cfg, meta = cls._resolve(spec, target_config)
        cls._settings(spec, cfg, meta, path)

    @classmethod
    def create(cls, spec, target, tokenizer) -> "BlockDrafter":
        from .format import build_block
        from ..checkpoint import check_target

        path, raw, cfg, meta = cls._resolve(spec, target.config)
        k, th, width, nodes = cls._settings(spec, cfg, meta, path)
        model = build_block(path, raw, target, cls.method)
        check_target(meta, target, tokenizer, path)
        cls._reduce_vocab(spec, meta, model, target, tokenizer, path)
        d = cls(model, k, th, width, nodes)
        d.checkpoint = {"path": path, "meta": meta}
        return d

    @staticmethod
    def _reduce_vocab(spec, meta, model, target, tokenizer, path) -> None:
        """FR-Spec's reduced draft vocabulary: the request's `draft_vocab` (ranked by its `token_map`, else the
        map bundled for the tokenizer), else the checkpoint's own `specloom.draft_vocab`; a size equal to the
        vocabulary keeps all of it (a request's way to turn a checkpoint's default off)."""
        from ..token_map import use_requested_vocabulary

        if model.config.draft_vocab_size:
            if spec.draft_vocab or spec.token_map:
                raise SpecloomError(f"{path}: this drafter's vocabulary is already reduced to "
                                    f"{model.config.draft_vocab_size} tokens (its d2t); draft_vocab / token_map "
                                    "cannot change it")
            return
        use_requested_vocabulary(spec, meta, model, target, tokenizer, path)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def memory(self) -> dict:
        from ..base import kv_bytes_per_1k, module_bytes

        c = self.model.config
        extra = [mod for mod in (self.model._shared.get("head"), self.model._shared.get("markov_w2")) if mod is not None]
        return {"weights": module_bytes(self.model, *extra),
                "kv_per_1k_tokens": kv_bytes_per_1k(c.num_layers, c.num_kv_heads, c.head_dim,
                                                    self.model.new_kv(1, dtype=self.kv_cache_dtype).kv_type)}


    # -- state: per row, target features of committed positions not yet in the drafter KV ---------------------
    def new_state(self) -> list:
        return []

    def _store(self, ctx):
        return own_store(ctx, self, lambda rows, n: self.model.new_kv(n, batch=rows, dtype=self.kv_cache_dtype))

    def _features(self, target_out) -> torch.Tensor:
        return torch.cat([target_out.hidden[c] for c in self.needs_hidden], dim=-1)  # (B, T, F)

    def prefill(self, ctx: DraftContext, target_out) -> None:
        self._store(ctx).truncate(0, row=ctx.row)
        ctx.state[:] = [self._features(target_out)[0]]

    def on_verified(self, ctxs, results, target_out) -> None:
        f = self._features(target_out)
        for b, (ctx, res) in enumerate(zip(ctxs, results)):
            ctx.state.append(path_rows(f[b], res.path))

    def _catch_up(self, ctxs, store) -> None:
        """The context keys/values of every row's newly committed positions, in one ragged pass (or one per
        group of rows that fits the store)."""
        feats = []
        for c in ctxs:
            feats.append(torch.cat(c.state) if len(c.state) > 1 else c.state[0])
            if store.lengths[c.row] + feats[-1].shape[0] != c.root_position:
                raise RuntimeError(f"{self.method} drafter out of step: {store.lengths[c.row]} + "
                                   f"{feats[-1].shape[0]} rows for root position {c.root_position}")
            c.state.clear()
        m = [f.shape[0] for f in feats]
        dev = feats[0].device
        for g in fitting_groups(ctxs, m, store):
            M = max(m[i] for i in g)
            x = torch.zeros(len(g), M, feats[0].shape[-1], dtype=feats[0].dtype, device=dev)
            pos = torch.zeros(len(g), M, dtype=torch.long)
            for j, i in enumerate(g):
                x[j, :m[i]] = feats[i]
                pos[j] = torch.arange(store.lengths[ctxs[i].row], store.lengths[ctxs[i].row] + M)
            p = store.begin([ctxs[i].row for i in g], [m[i] for i in g])
            self.model.extend(p, p.spread(x), p.spread(pos.to(dev)))
            store.commit()

    # -- proposing -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctxs) -> list[DraftTree]:
        store, span = self._store(ctxs[0]), RowSpan([c.row for c in ctxs])
        self._catch_up(ctxs, store)
        m = self.model
        ks = [min(c.k, self.k) for c in ctxs]
        K, B = max(ks), len(ctxs)
        s0 = m.config.first_slot
        dev = m.fc.weight.device
        roots = torch.tensor([c.tokens[-1] for c in ctxs], device=dev)
        n = torch.tensor([c.root_position for c in ctxs], device=dev)
        h = span.pick(m.draft_block(store, span, span.spread(roots), span.spread(n)))[:, s0:s0 + K]  # (B, K, H)
        logits = m.draft_logits(h)  # (B, K, V)
        if self.width > 1:
            return self._tree(ctxs, ks, h, logits, roots)
        drafts = [[] for _ in ctxs]
        qs = [[] for _ in ctxs]
        live = list(ks)  # drafts each row still takes (the confidence cut ends a row's chain early)
        prev, state = roots, None
        for p in range(K):
            if m.has_confidence and self.threshold > 0:
                conf = torch.sigmoid(m.confidence_logit(h[:, p], prev)).view(B).tolist()
                for b in range(B):
                    if p < live[b] and conf[b] < self.threshold:
                        live[b] = p
            lp, state = m.chain_logits(logits[:, p], h[:, p], prev, state)
            prev = torch.tensor(draw(ctxs, lp, [p < lv for lv in live], drafts, qs, m.to_target_ids,
                                     m.expand_logits), device=dev)
        return chains(ctxs, drafts, qs)

    def _tree(self, ctxs, ks: list[int], h, logits, roots) -> list[DraftTree]:
        """The beam over the slots for every row at once: (B, ...) tensors, one host read (`keep_best`)."""
        m, w = self.model, self.width
        B, K, V = logits.shape
        lg, state = m.chain_logits(logits[:, 0], h[:, 0], roots)
        top = torch.log_softmax(lg.float(), -1).topk(min(w, V), -1)
        toks, scores = [top.indices], [top.values]
        parents = [torch.full_like(top.indices, -1)]
        f_ids, f_tok, f_score = torch.arange(top.indices.shape[1], device=h.device)[None].expand(B, -1), \
            top.indices, top.values
        depth = [torch.ones(top.indices.shape[1], dtype=torch.long, device=h.device)]
        offset = top.indices.shape[1]
        fw = f_tok.shape[1]
        if state is not None:
            state = state[:, None].expand(B, fw, state.shape[-1])
        for d in range(1, K):
            lg, st = m.chain_logits(logits[:, d, None].expand(B, fw, V), h[:, d, None].expand(B, fw, h.shape[-1]),
                                    m.to_target_ids(f_tok), state)
            cand = (torch.log_softmax(lg.float(), -1) + f_score[..., None]).topk(min(w, V), -1)  # (B, fw, w)
            cw = cand.indices.shape[-1]
            toks.append(cand.indices.reshape(B, -1))
            scores.append(cand.values.reshape(B, -1))
            parents.append(f_ids[..., None].expand(B, fw, cw).reshape(B, -1))
            depth.append(torch.full((fw * cw,), d + 1, dtype=torch.long, device=h.device))
            best = scores[-1].topk(min(w, fw * cw), -1).indices  # the next frontier: the depth's w best
            f_ids, f_tok, f_score = offset + best, toks[-1].gather(1, best), scores[-1].gather(1, best)
            if st is not None:
                state = st.gather(1, (best // cw)[..., None].expand(B, best.shape[1], st.shape[-1]))
            offset += fw * cw
            fw = f_tok.shape[1]
        toks, scores, parents = m.to_target_ids(torch.cat(toks, 1)), torch.cat(scores, 1), torch.cat(parents, 1)
        depth = torch.cat(depth)
        valid = (depth[None] <= torch.tensor(ks, device=h.device)[:, None]) & torch.isfinite(scores)
        budgets = [self.num_nodes if c.max_nodes is None else min(self.num_nodes, c.max_nodes) for c in ctxs]
        n_keep = [min(b, int(v)) for b, v in zip(budgets, valid.sum(1).tolist())]
        return keep_best(ctxs, toks, scores, parents, valid, n_keep)


@register("dflash", {"confidence_threshold": float_key(0.0, 1.0), **TREE_KEYS, **VOCAB_KEYS}, (".trainer",))
class DFlashDrafter(BlockDrafter):
    pass


@register("dflash2", {**TREE_KEYS, **VOCAB_KEYS}, (".trainer",), no_export="speculators' DFlash 2 layout is not public; its checkpoint is "
                                                  "z-lab's (DFlash2DraftModel), which vLLM reads as it is")
class DFlash2Drafter(BlockDrafter):
    pass


@register("dspark", {"confidence_threshold": float_key(0.0, 1.0), **TREE_KEYS, **VOCAB_KEYS}, (".trainer",))
class DSparkDrafter(BlockDrafter):
    @classmethod
    def find(cls, spec, target_config) -> str:
        from ..checkpoint import find_builtin_dir, find_drafter_dir

        if spec.model:
            return find_drafter_dir(spec.model, cls.method, target_config)
        return find_builtin_dir(cls.method, target_config, declares=_declares_dspark)

    @classmethod
    def _settings(cls, spec, cfg, meta, path):
        k = spec.num_speculative_tokens
        if k is not None and k != cfg.num_drafts:
            raise SpecloomError(
                f"{path}: this DSpark drafter was trained with a block of {cfg.block_size} and drafts exactly "
                f"{cfg.num_drafts} tokens in one pass; num_speculative_tokens={k} cannot be served ("
                + ("slots past the block were never trained, so they would accept almost nothing"
                   if k > cfg.num_drafts else
                   "its block is one trained unit of that many slots; to draft fewer tokens where the drafter is "
                   "unsure, set confidence_threshold instead")
                + f") -- omit it or set it to {cfg.num_drafts}")
        return super()._settings(spec, cfg, meta, path)
