"""`mtp`: multi-token-prediction layers shipped inside the target checkpoint, run through the EAGLE code path.

Settings: `model` (a checkpoint directory holding MTP layers; omitted = the target's own checkpoint, or the MTP
layers bundled with specloom for this target), `num_speculative_tokens` (draft depth; default = the number of MTP
layers), `tree_width` / `num_draft_tokens` (EAGLE-2 dynamic trees, as for `eagle`).

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

from .base import DraftContext, register
from .eagle import EagleDrafter

log = logging.getLogger("specloom")


class _MTPAdapter:
    """What EagleDrafter's chain and tree code read from `self.model` (full target vocabulary: no mapping)."""

    def __init__(self, model):
        self.mtp = model

    @staticmethod
    def to_target_ids(ids):
        return ids

    @staticmethod
    def expand_logits(logits):
        return logits


@register("mtp")
class MTPDrafter(EagleDrafter):
    def __init__(self, mtp, depth: int, width: int, num_nodes: int | None):
        self.mtp = mtp
        self.model = _MTPAdapter(mtp)
        self.depth = depth
        self.width = width
        self.num_nodes = num_nodes or depth * width
        self.needs_hidden = (mtp.config.num_layers,)  # the target's final (post-norm) hidden state
        N = mtp.num_layers
        self.kvs = [None] * N
        self.stables = [0] * N
        self._pending: list[torch.Tensor | None] = [None] * N  # h^{i-1} rows not yet fed to layer i
        self._feats: list[torch.Tensor] = []

    @classmethod
    def check(cls, spec, target_config) -> None:
        from .mtp_format import find_mtp_dir, read_mtp_config

        read_mtp_config(find_mtp_dir(spec.model, target_config), target_config)

    @classmethod
    def create(cls, spec, target, tokenizer) -> "MTPDrafter":
        from .mtp_format import find_mtp_dir, load_mtp

        path = find_mtp_dir(spec.model, target.config)
        mtp, meta = load_mtp(path, target, tokenizer)
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
        return cls(mtp, depth, width, nodes or depth * width)

    def memory(self) -> dict:
        from .base import kv_bytes_per_1k, module_bytes

        c = self.mtp.config
        dt = self.kvs[0].dtype if self.kvs[0] is not None else torch.float32
        return {"weights": module_bytes(self.mtp),
                "kv_per_1k_tokens": kv_bytes_per_1k(self.mtp.num_layers, c.num_kv_heads, c.head_dim, dt)}

    # -- state -----------------------------------------------------------------------------------------------
    def prefill(self, ctx: DraftContext, target_out) -> None:
        n = len(ctx.tokens)
        for i in range(self.mtp.num_layers):
            if self.kvs[i] is None or self.kvs[i].max_len < n + 4096:
                self.kvs[i] = self.mtp.new_kv(n + 4096)
            self.kvs[i].reset()
        self.stables = [0] * self.mtp.num_layers
        self._pending = [None] * self.mtp.num_layers
        self._feats = [self._features(target_out)]

    @torch.inference_mode()
    def _catch_up(self, ctx: DraftContext) -> torch.Tensor:
        """Feed every layer the committed rows it can now compute; return layer 0's output at row n-1."""
        n = len(ctx.tokens) - 1
        m = self.mtp
        dev = m.device
        h_in = torch.cat(self._feats)[None]  # (1, rows, H): target features for layer 0's new rows
        self._feats = []
        h0 = out = None
        for i in range(m.num_layers):
            kv = self.kvs[i]
            kv.truncate(self.stables[i])
            if kv.max_len < n + self.num_nodes + self.depth + 64:
                self.kvs[i] = kv = kv.grown(n + 4096)
            if i > 0:
                pend = self._pending[i]
                h_in = out if pend is None else torch.cat([pend, out], 1)
            last = n - 1 - i  # the last row whose token x_{t+1+i} is committed
            rows = last - self.stables[i] + 1
            if rows <= 0:
                self._pending[i] = h_in if h_in.shape[1] else None
                out = h_in[:, :0]
                continue
            self._pending[i] = h_in[:, rows:] if h_in.shape[1] > rows else None
            start = self.stables[i]
            toks = torch.tensor([ctx.tokens[start + 1 + i:last + 2 + i]], device=dev)
            pos = torch.arange(start, last + 1, device=dev)[None]
            out = m(i, h_in[:, :rows], toks, pos, kv)
            kv.commit()
            self.stables[i] = last + 1
            if i == 0:
                h0 = out[:, -1]
        return h0

    # -- hooks for EagleDrafter's chain / tree ---------------------------------------------------------------
    def _kv(self, depth: int):
        return self.kvs[depth % self.mtp.num_layers]

    def _base(self, depth: int) -> int:
        return self.stables[depth % self.mtp.num_layers]

    def _position(self, n: int, depth: int) -> int:
        return n - 1 + depth // self.mtp.num_layers

    def _logits(self, h, depth: int):
        return self.mtp.logits(depth % self.mtp.num_layers, h)

    def _drop_tree_rows(self) -> None:
        for kv, s in zip(self.kvs, self.stables):
            kv.truncate(s)

    def _row(self, h, tokens: list[int], depth: int, n: int, mask=None):
        dev = h.device
        i = depth % self.mtp.num_layers
        kv = self.kvs[i]
        t = torch.tensor([tokens], device=dev)
        pos = torch.full((1, len(tokens)), self._position(n, depth), device=dev)
        if mask is None:  # a chain row sees the layer's committed rows and its own earlier rows of this step
            mask = torch.ones(len(tokens), kv.length + len(tokens), dtype=torch.bool, device=dev)
        out = self.mtp(i, h[None], t, pos, kv, attn_mask=mask)
        kv.commit()
        return out[0]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext):
        from ..tree import DraftTree

        root = ctx.tokens[-1]
        h = self._catch_up(ctx)
        if ctx.k <= 0 or h is None:
            return DraftTree.chain(root, [])
        if self.width == 1:
            return self._chain(ctx, h)
        return self._tree(ctx, h)
