"""The draft-model trainer (`specloom train draft_model`): the target's first layers, distilled on its
distributions, written as a HF Llama directory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...training.common import _Base, _sample_rows, _shift, _soft_ce, save_hf_llama
from ..base import trainer
from ...training.options import draft_layers_option
from ...training.distributed import shard_mean, total_rows


@trainer("draft_model")
class DraftModelTrainer(_Base):
    """A small LM with the target's tokenizer: the target's first `--draft-layers` layers, its final norm and
    (tied, frozen) embedding/head, distilled on the target's distributions. Saved as a HF Llama directory."""

    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        import dataclasses

        from ...loading.weights import build_model

        self.feature_ids = (self.L,)
        n = args.draft_layers or 2
        cfg = dataclasses.replace(target.config, num_layers=n)
        from ...models.ggml_linear import dense_state

        sd = {k: v.detach().float().clone() for k, v in dense_state(target).items()
              if not k.startswith("layers.") or int(k.split(".")[1]) < n}
        sd.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
        self.model = build_model(cfg, sd)
        self.model.requires_grad_(False)
        for p in self.model.layers.parameters():
            p.requires_grad_(True)
        self.model.norm.weight.requires_grad_(True)
        self.model.train()

    def loss(self, batch):
        tokens, valid = batch["tokens"], batch["valid"]
        B, T = tokens.shape
        dev = tokens.device
        kv = self.model.new_kv(T, dtype=torch.float32, batch=B)
        pos = torch.arange(T, device=dev)[None].expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :]
        mask |= torch.eye(T, dtype=torch.bool, device=dev)[None]
        out = self.model(tokens, pos, kv, attn_mask=mask, capture=(cfg_l := self.model.config.num_layers,))
        h = out.hidden[cfg_l]
        rows = _sample_rows(valid, self.args.loss_fraction, self.gen)
        n = total_rows(rows.numel())  # over all processes' shares of the batch (training/distributed.py)
        tgt = self.target_logits(batch["hidden"][self.L].flatten(0, 1)[rows])
        logits = self.target_logits(h.flatten(0, 1)[rows])
        loss = shard_mean(_soft_ce(logits, tgt), n)
        return loss, {"acc0": float(shard_mean((logits.argmax(-1) == tgt.argmax(-1)).float(), n))}

    def target_logits(self, h, rows=None):
        return F.linear(h.to(self.head_w.dtype), self.head_w).float()

    def save(self, path, meta):
        save_hf_llama(self.model, path, meta)
        self.tokenizer.hf.save_pretrained(path)

    def init_from(self, path: str) -> None:
        from ...loading import load_target

        m, _ = load_target(path, "fp32", pack=False, progress=False)
        self.model.load_state_dict(m.state_dict(), strict=False)


def add_arguments(t) -> None:
    """`specloom train draft_model` options."""
    draft_layers_option(t)
