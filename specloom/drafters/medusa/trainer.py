"""The Medusa trainer (`specloom train medusa`): each head learns the target's distribution k+1 positions ahead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...training.common import _Base, _sample_rows, _shift, _soft_ce, to_device, trainer


@trainer("medusa")
class MedusaTrainer(_Base):
    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from .drafter import MedusaHeads

        self.feature_ids = (self.L,)
        self.model = MedusaHeads(target.config.hidden_size, args.medusa_heads, 1, None)
        self.model.attach_target(target)

    def loss(self, batch):
        final = batch["hidden"][self.L]
        valid = batch["valid"]
        total, metrics = 0.0, {}
        for k, head in enumerate(self.model):
            ok = _shift(valid, 1 + k) & valid  # head k at row t: the target's distribution at t+1+k
            rows = _sample_rows(ok, self.args.loss_fraction, self.gen)
            if rows.numel() == 0:
                continue
            x = final.flatten(0, 1)[rows]
            tgt = F.linear(_shift(final, 1 + k).flatten(0, 1)[rows].to(self.head_w.dtype), self.head_w).float()
            logits = F.linear(head(x.to(head[0].linear.weight.dtype)).to(self.head_w.dtype), self.head_w).float()
            total = total + (0.8 ** k) * _soft_ce(logits, tgt).mean()
            metrics[f"acc{k}"] = float((logits.argmax(-1) == tgt.argmax(-1)).float().mean())
        return total, metrics

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("medusa", self.model, path, {**meta, "target": self.args.target})

    def extra_meta(self, data, index) -> dict:
        return {"topk_accuracy": topk_accuracy(self, data, index, self.args)}


@torch.no_grad()
def topk_accuracy(tr, data, index, args, max_batches: int = 4) -> list[list[float]]:
    """Per head, the fraction of rows whose target argmax is the head's rank-r candidate (for tree building)."""
    from .drafter import TOPK

    K = tr.model.num_heads
    hits = torch.zeros(K, TOPK)
    count = torch.zeros(K)
    for b, batch in enumerate(data.batches(index, args.tokens_per_batch, seed=0)):
        if b >= max_batches:
            break
        batch = to_device(batch, tr.target.device)
        final, valid = batch["hidden"][tr.L], batch["valid"]
        for k, head in enumerate(tr.model):
            ok = (_shift(valid, 1 + k) & valid).flatten()
            x = final.flatten(0, 1)[ok]
            tgt = F.linear(_shift(final, 1 + k).flatten(0, 1)[ok].to(tr.head_w.dtype), tr.head_w).argmax(-1)
            top = F.linear(head(x.to(head[0].linear.weight.dtype)).to(tr.head_w.dtype), tr.head_w).topk(TOPK).indices
            hits[k] += (top == tgt[:, None]).float().sum(0).cpu()
            count[k] += int(ok.sum())
    return (hits / count.clamp(min=1)[:, None]).tolist()
