"""`mtp`: multi-token-prediction layers shipped inside the target checkpoint, run through the EAGLE code path.

Settings: `model` (a checkpoint directory holding MTP layers; omitted = the target's own checkpoint, or the MTP
layers bundled with specloom for this target), `num_speculative_tokens` (draft depth; default = the number of MTP
layers), `tree_width` / `num_draft_tokens` (EAGLE-2 dynamic trees, as for `eagle`), `draft_vocab` / `token_map`
(FR-Spec: only those rows of the target's head score the drafts).

Draft step j uses MTP layer j mod N, each layer with its own drafter KV cache (drafters.md §4):

* Layer i's cache holds its rows for committed positions: row t reads h^{i-1}_t (i = 0: the target's final hidden
  state f_t) and token x_{t+1+i}, so it runs i rows behind layer i-1 (the catch-up feeds what is committed).
* Step j < N runs layer j at row n-1 (n = root position) on the previous step's output and the token drafted at
  step j -- exactly DeepSeek's sequential MTP (for j >= 2 the rows between the committed ones and n-1 hold drafted
  tokens and are skipped).
* Steps j >= N reuse the layers (with a warning, as vLLM does with `spec_step_idx % num_mtp_layers`), one position
  further per round: the EAGLE pairing, where the MTP output stands in for the target's feature.

Everything is exact whatever the drafts: the target verifies.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..base import TREE_KEYS, VOCAB_KEYS, register
from ..eagle.drafter import EagleDrafter
from ..rows import fitting_groups, own_store

log = logging.getLogger("specloom")


class _MTPAdapter:
    """What EagleDrafter's chain and tree code read from `self.model`: the target vocabulary, or a reduced one
    (`draft_vocab`: draft ids map back to target ids, -inf outside it)."""

    def __init__(self, model):
        self.mtp = model

    def to_target_ids(self, ids):
        v = self.mtp.draft_vocab
        return ids if v is None else v[ids]

    def expand_logits(self, logits):
        from ..token_map import expand_logits

        v = self.mtp.draft_vocab
        return logits if v is None else expand_logits(logits, v, self.mtp.config.vocab_size)


@register("mtp", {**TREE_KEYS, **VOCAB_KEYS}, (".trainer", ".train_target"))
class MTPDrafter(EagleDrafter):
    def __init__(self, mtp, depth: int, width: int, num_nodes: int | None):
        self.mtp = mtp
        self.model = _MTPAdapter(mtp)
        self.depth = depth
        self.width = width
        self.num_nodes = num_nodes or depth * width
        self.needs_hidden = (mtp.config.num_layers,)  # the target's final (post-norm) hidden state

    @classmethod
    def check(cls, spec, target_config) -> None:
        from .format import find_mtp_dir, read_mtp_config

        read_mtp_config(find_mtp_dir(spec.model, target_config), target_config)

    @classmethod
    def create(cls, spec, target, tokenizer) -> "MTPDrafter":
        from ..token_map import use_requested_vocabulary
        from .format import find_mtp_dir, load_mtp

        path = find_mtp_dir(spec.model, target.config)
        mtp, meta = load_mtp(path, target, tokenizer)
        use_requested_vocabulary(spec, meta, mtp, target, tokenizer, path)  # FR-Spec: rows of the target's head
        N = mtp.num_layers
        depth = spec.num_speculative_tokens or meta.get("depth") or N
        if depth > N:
            msg = (f"mtp: {depth} speculative tokens with {N} MTP layer(s): steps past {N} reuse the layers "
                   "(step j runs layer j mod N), which were not trained for them; acceptance there will be lower")
            warnings.warn(msg, stacklevel=2)
            log.warning("specloom: warning: %s", msg)
        width = spec.tree_width or meta.get("tree_width") or 1
        nodes = spec.num_draft_tokens or (meta.get("num_draft_tokens") if width > 1 else None)
        if width == 1:
            nodes = depth
        d = cls(mtp, depth, width, nodes or depth * width)
        d.checkpoint = {"path": path, "meta": meta}
        return d

    def memory(self) -> dict:
        from ..base import kv_bytes_per_1k, module_bytes

        c = self.mtp.config
        own_head = [self.mtp._shared["head"]] if self.mtp.draft_vocab is not None else []
        return {"weights": module_bytes(self.mtp, *own_head),  # a reduced vocabulary's rows are a copy
                "kv_per_1k_tokens": kv_bytes_per_1k(self.mtp.num_layers, c.num_kv_heads, c.head_dim,
                                                    self.mtp.new_kv(1, dtype=self.kv_cache_dtype).kv_type)}


    # -- state -----------------------------------------------------------------------------------------------
    def new_state(self) -> _MTPState:
        return _MTPState(self.mtp.num_layers)

    def _stores(self, ctx) -> list:
        return [own_store(ctx, (self, i),
                          lambda rows, n: self.mtp.new_kv(n, batch=rows, dtype=self.kv_cache_dtype))
                for i in range(self.mtp.num_layers)]

    def _reset(self, ctx) -> None:
        ctx.state.pending = [None] * self.mtp.num_layers

    @torch.inference_mode()
    def _catch_up(self, ctxs) -> torch.Tensor:
        """Feed every layer the committed rows it can now compute (one ragged pass per layer for all rows);
        return layer 0's output at row n-1 of every row (B, H)."""
        m = self.mtp
        dev = m.device
        stores = self._stores(ctxs[0])
        h_in = self._take_feats(ctxs)  # per row (rows, H): target features for layer 0's new rows
        outs = [None] * len(ctxs)
        h0 = None
        for i in range(m.num_layers):
            store = stores[i]
            go, sizes = [], []
            for b, c in enumerate(ctxs):
                if i > 0:
                    pend = c.state.pending[i]
                    h_in[b] = outs[b] if pend is None else torch.cat([pend, outs[b]])
                last = c.root_position - 1 - i  # the last row whose token x_{t+1+i} is committed
                rows = last - store.lengths[c.row] + 1
                if rows <= 0:
                    c.state.pending[i] = h_in[b] if h_in[b].shape[0] else None
                    outs[b] = h_in[b][:0]
                    continue
                c.state.pending[i] = h_in[b][rows:] if h_in[b].shape[0] > rows else None
                go.append(b)
                sizes.append(rows)
            if not go:
                continue
            H = h_in[go[0]].shape[-1]
            for g in fitting_groups([ctxs[b] for b in go], sizes, store):
                grp = [go[j] for j in g]
                rs = [sizes[j] for j in g]
                M = max(rs)
                x = torch.zeros(len(grp), M, H, dtype=h_in[grp[0]].dtype, device=dev)
                toks = torch.zeros(len(grp), M, dtype=torch.long)
                pos = torch.zeros(len(grp), M, dtype=torch.long)
                for j, (b, r) in enumerate(zip(grp, rs)):
                    c, start = ctxs[b], store.lengths[ctxs[b].row]
                    x[j, :r] = h_in[b][:r]
                    toks[j, :r] = torch.tensor(c.tokens[start + 1 + i:start + 1 + i + r])
                    pos[j] = torch.arange(start, start + M)
                p = store.begin([ctxs[b].row for b in grp], rs)
                out = p.pick(m(i, p.spread(x), p.spread(toks.to(dev)), p.spread(pos.to(dev)), p))
                store.commit()
                for j, (b, r) in enumerate(zip(grp, rs)):
                    outs[b] = out[j, :r]
            if i == 0:
                h0 = torch.stack([outs[b][-1] for b in range(len(ctxs))])
        return h0

    # -- hooks for EagleDrafter's chain / tree ---------------------------------------------------------------
    def _layer(self, depth: int) -> int:
        return depth % self.mtp.num_layers

    def _position(self, n: int, depth: int) -> int:
        return n - 1 + depth // self.mtp.num_layers

    def _logits(self, h, depth: int):
        return self.mtp.logits(depth % self.mtp.num_layers, h)

    def _rows(self, h, tokens, depth: int, ctxs, mask=None):
        store = self._stores(ctxs[0])[self._layer(depth)]
        dev = h.device
        B, T = tokens.shape
        pos = torch.tensor([[self._position(c.root_position, depth)] * T for c in ctxs], device=dev)
        p = store.begin([c.row for c in ctxs], [T] * B)
        out = self.mtp(self._layer(depth), p.spread(h), p.spread(tokens), p.spread(pos), p,
                       attn_mask=None if mask is None else p.spread(mask, True))
        store.commit()
        return p.pick(out)


class _MTPState:
    __slots__ = ("feats", "base", "pending")

    def __init__(self, layers: int):
        self.feats: list[torch.Tensor] = []
        self.base: list[int] = []
        self.pending: list[torch.Tensor | None] = [None] * layers  # h^{i-1} rows not yet fed to layer i
