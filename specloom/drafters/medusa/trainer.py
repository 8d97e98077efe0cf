"""The Medusa trainer (`specloom train medusa`): each head learns the target's distribution k+1 positions ahead.

With `--draft-vocab N` / `--draft-vocab-coverage F` the heads score only the most frequent answer tokens (their
`token_map`, through the target's LM-head rows for them); the loss is then the soft cross-entropy against the
target's distribution restricted to those tokens, on the positions whose label token is one of them (as EAGLE-3)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ...training.common import _Base, _sample_rows, _shift, _soft_ce, draft_vocabulary, to_device
from ..base import trainer
from ...training.options import draft_vocabulary_options, option, positive_int
from ...training.distributed import shard_mean, total_rows


@trainer("medusa")
class MedusaTrainer(_Base):
    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from ...errors import SpecloomError
        from .drafter import TOPK, MedusaHeads

        self.feature_ids = (self.L,)
        V = target.config.vocab_size
        token_map, self.coverage = None, 1.0
        cap, share = getattr(args, "draft_vocab", None), getattr(args, "draft_vocab_coverage", None)
        if cap is not None or share is not None:
            if cap is not None and cap < TOPK:
                raise SpecloomError(f"--draft-vocab must be at least {TOPK} for Medusa (its trees use the top "
                                    f"{TOPK} of each head), got {cap}")
            used, self.coverage = draft_vocabulary(data, V, cap, share)
            if used.numel() < V:
                token_map = used
                print(f"specloom train: head vocabulary {used.numel()} tokens covers {self.coverage:.1%} of the "
                      "answer tokens", file=sys.stderr)
        self.model = MedusaHeads(target.config.hidden_size, args.medusa_heads, 1, None, token_map)
        self.model.attach_target(target)

    def _in_vocab(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whether each token is one the heads score (all True without a token_map)."""
        tm = self.model.token_map
        if tm is None:
            return torch.ones_like(tokens, dtype=torch.bool)
        member = torch.zeros(self.target.config.vocab_size, dtype=torch.bool, device=tokens.device)
        member[tm.to(tokens.device)] = True
        return member[tokens]

    def rows(self) -> torch.Tensor:
        """The target LM-head rows the heads score, (V or V_d, H) (read per call: a resume may load a token_map)."""
        tm = self.model.token_map
        return self.head_w if tm is None else self.head_w[tm.to(self.head_w.device)]

    def loss(self, batch):
        final = batch["hidden"][self.L]
        valid, inv = batch["valid"], self._in_vocab(batch["tokens"])
        w = self.rows()
        total, metrics = 0.0, {}
        for k, head in enumerate(self.model):
            # head k at row t: the target's distribution at t+1+k, whose label x_{t+2+k} the heads can score
            ok = _shift(valid, 1 + k) & valid & _shift(inv, 2 + k)
            rows = _sample_rows(ok, self.args.loss_fraction, self.gen)
            n = total_rows(rows.numel())  # over all processes' shares of the batch (training/distributed.py)
            if n == 0:
                continue
            x = final.flatten(0, 1)[rows]
            tgt = F.linear(_shift(final, 1 + k).flatten(0, 1)[rows].to(w.dtype), w).float()
            logits = F.linear(head(x.to(head[0].linear.weight.dtype)).to(w.dtype), w).float()
            total = total + (0.8 ** k) * shard_mean(_soft_ce(logits, tgt), n)
            metrics[f"acc{k}"] = float(shard_mean((logits.argmax(-1) == tgt.argmax(-1)).float(), n))
        return total, metrics

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        extra = {} if self.model.token_map is None else {"draft_vocab_coverage": round(self.coverage, 4)}
        save_drafter("medusa", self.model, path, {**meta, "target": self.args.target, **extra})

    def extra_meta(self, data, index) -> dict:
        return {"topk_accuracy": topk_accuracy(self, data, index, self.args)}


@torch.no_grad()
def topk_accuracy(tr, data, index, args, max_batches: int = 4) -> list[list[float]]:
    """Per head, the fraction of rows whose target argmax is the head's rank-r candidate (for tree building; a
    target argmax outside a truncated head vocabulary counts as a miss at every rank)."""
    from .drafter import TOPK

    K = tr.model.num_heads
    hits = torch.zeros(K, TOPK)
    count = torch.zeros(K)
    w = tr.rows()
    for b, batch in enumerate(data.batches(index, args.tokens_per_batch, seed=0)):
        if b >= max_batches:
            break
        batch = to_device(batch, tr.target.device)
        final, valid = batch["hidden"][tr.L], batch["valid"]
        for k, head in enumerate(tr.model):
            ok = (_shift(valid, 1 + k) & valid).flatten()
            x = final.flatten(0, 1)[ok]
            tgt = F.linear(_shift(final, 1 + k).flatten(0, 1)[ok].to(tr.head_w.dtype), tr.head_w).argmax(-1)
            top = F.linear(head(x.to(head[0].linear.weight.dtype)).to(w.dtype), w).topk(TOPK).indices
            top = tr.model.target_ids(top.to(tgt.device))
            hits[k] += (top == tgt[:, None]).float().sum(0).cpu()
            count[k] += int(ok.sum())
    return (hits / count.clamp(min=1)[:, None]).tolist()


def add_arguments(t) -> None:
    """`specloom train medusa` options."""
    option(t, "--medusa-heads", type=positive_int, default=4)
    draft_vocabulary_options(t)
