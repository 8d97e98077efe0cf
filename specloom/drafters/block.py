"""Block drafters at inference: `dflash` and `dspark` (drafters.md §5.2, §6.1). One drafter pass per step.

Per step: the drafter KV takes the context keys/values of the newly committed positions (the prefill's prompt
positions, then the rows `result.path` of each verification pass); the block [root, MASK ...] at positions
n .. n+B-1 (n = the root's position) runs once over that context; its slots give the drafts, a chain:

* DFlash: slots 1..B-1 (slot p predicts position n+p), each the argmax / a sample of its own distribution;
  `num_speculative_tokens` defaults to B-1 and may be lower, never higher.
* DSpark: slots 0..B-1 (slot p predicts position n+p+1), left to right, each slot's logits plus the Markov bias
  of the token chosen before it (slot 0: the root), q = that corrected distribution. `num_speculative_tokens`
  must be B: the slots are one trained block. With a confidence head and `confidence_threshold` > 0 the chain
  stops before the first slot whose confidence (computed from the slot and the previous choice, before the slot's
  own token is drawn) is below the threshold -- which tokens get verified never depends on the token itself, so
  the output stays exact; only verification decides what is kept.

Settings: `model` (checkpoint directory; DFlash omitted = the drafter bundled for the target; DSpark omitted = the
one built into the target checkpoint, else an overlay bundled for the target), `num_speculative_tokens`,
`confidence_threshold` (dspark; default the checkpoint's `confidence_threshold`, else off).
"""

from __future__ import annotations

import os

import torch

from ..errors import SpecloomError
from ..sampling import probs_from_logits
from ..tree import DraftTree
from .base import DraftContext, Drafter, register


def _declares_dspark(raw: dict) -> bool:
    return "dspark_block_size" in raw


class BlockDrafter(Drafter):
    def __init__(self, model, k: int, threshold: float):
        self.model = model
        self.k = k
        self.threshold = threshold
        self.needs_hidden = tuple(model.config.feature_ids)
        self.kv = None
        self._feats: list[torch.Tensor] = []  # target features of committed positions not yet in the drafter KV

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def find(cls, spec, target_config) -> str:
        from .checkpoint import find_drafter_dir

        return find_drafter_dir(spec.model, cls.method, target_config)

    @classmethod
    def _settings(cls, spec, cfg, meta, path) -> tuple[int, float]:
        """(drafts per step, confidence threshold) from the settings and the checkpoint; SpecloomError if bad."""
        if spec.tree_width not in (None, 1) or spec.num_draft_tokens is not None:
            raise SpecloomError(f"{cls.method} drafts one chain per step: tree_width / num_draft_tokens do not apply")
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
        if th is None:
            th = float(meta.get("confidence_threshold") or 0.0) if cfg.confidence_head else 0.0
        return k or n, th

    @classmethod
    def _resolve(cls, spec, target_config):
        from .block_format import block_config, meta_of
        from .checkpoint import _load_json

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
        from .block_format import build_block
        from .checkpoint import check_target

        path, raw, cfg, meta = cls._resolve(spec, target.config)
        k, th = cls._settings(spec, cfg, meta, path)
        model = build_block(path, raw, target, cls.method)
        check_target(meta, target, tokenizer, path)
        return cls(model, k, th)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def memory(self) -> dict:
        from .base import kv_bytes_per_1k, module_bytes

        c = self.model.config
        dt = self.kv.dtype if self.kv is not None else torch.float32
        return {"weights": module_bytes(self.model),
                "kv_per_1k_tokens": kv_bytes_per_1k(c.num_layers, c.num_kv_heads, c.head_dim, dt)}

    # -- state -----------------------------------------------------------------------------------------------
    def _features(self, target_out, rows=None) -> torch.Tensor:
        f = torch.cat([target_out.hidden[c] for c in self.needs_hidden], dim=-1)[0]  # (T, F)
        return f if rows is None else f[rows]

    def prefill(self, ctx: DraftContext, target_out) -> None:
        n = len(ctx.tokens)
        if self.kv is None or self.kv.max_len < n + 1024:
            self.kv = self.model.new_kv(n + 4096)
        self.kv.reset()
        self._feats = [self._features(target_out)]

    def on_verified(self, ctx: DraftContext, result, target_out) -> None:
        self._feats.append(self._features(target_out, torch.tensor(result.path, device=target_out.logits.device)))

    def _catch_up(self, n: int) -> None:
        feats = torch.cat(self._feats)[None]  # (1, m, F): positions kv.length .. n-1
        self._feats = []
        m = feats.shape[1]
        if self.kv.length + m != n:
            raise RuntimeError(f"{self.method} drafter out of step: {self.kv.length} + {m} rows for root position {n}")
        if self.kv.max_len < n + 1:
            self.kv = self.kv.grown(n + 4096)
        if m:
            self.model.extend(self.kv, feats)

    # -- proposing -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> DraftTree:
        root = ctx.tokens[-1]
        n = len(ctx.tokens) - 1
        self._catch_up(n)
        k = min(ctx.k, self.k)
        if k <= 0:
            return DraftTree.chain(root, [])
        m = self.model
        s0 = m.config.first_slot
        h = m.draft_block(self.kv, root, n)[s0:s0 + k]  # (k, H)
        logits = m.draft_logits(h)  # (k, V)
        drafts, qs = [], []
        prev = torch.tensor([root], device=h.device)
        state = None
        for p in range(k):
            if m.has_confidence and self.threshold > 0:
                c = torch.sigmoid(m.confidence_logit(h[p:p + 1], prev))
                if float(c) < self.threshold:
                    break
            lp = logits[p:p + 1]
            if m.has_markov:
                bias, state = m.markov_bias(prev, h[p:p + 1], state)
                lp = lp + bias
            if ctx.params.greedy:
                tok = int(lp.argmax())
            else:
                q = probs_from_logits(lp[0], ctx.params)
                tok = int(torch.multinomial(q, 1, generator=ctx.generator))
                qs.append(q)
            drafts.append(tok)
            prev = torch.tensor([tok], device=h.device)
        return DraftTree.chain(root, drafts, torch.stack(qs) if qs else None)


@register("dflash")
class DFlashDrafter(BlockDrafter):
    pass


@register("dspark")
class DSparkDrafter(BlockDrafter):
    @classmethod
    def find(cls, spec, target_config) -> str:
        from .checkpoint import find_builtin_dir, find_drafter_dir

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
