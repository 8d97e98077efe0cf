"""Trainers for EAGLE-3 and EAGLE-1 (`specloom train eagle3|eagle`): the training-time test over the network
in model.py, labels from the target's head."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ...training.common import _Base, _sample_rows, _shift, _soft_ce, trainer


@trainer("eagle3")
class Eagle3Trainer(_Base):
    @classmethod
    def data_ids(cls, L):
        from ...training.selfdistill import eagle3_layer_ids

        return tuple(sorted({*eagle3_layer_ids(L), L}))

    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from .model import EagleDraftModel, eagle_config_for, init_weights
        from ...training.selfdistill import eagle3_layer_ids

        self.feature_ids = eagle3_layer_ids(self.L)
        vd = min(args.draft_vocab, target.config.vocab_size)
        counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
        for t, _, _ in data.seqs:
            counts += torch.bincount(t, minlength=counts.numel())
        used = counts.topk(vd).indices.sort().values
        cfg = eagle_config_for(target.config, True, self.feature_ids, vd)
        self.model = EagleDraftModel(cfg)
        init_weights(self.model, args.seed)
        self.model.d2t.copy_(used - torch.arange(vd))
        self.model.t2d.zero_()
        self.model.t2d[used] = True
        self.used = used
        with torch.no_grad():  # speculators' recipe: start the draft head from the target's rows
            self.model.lm_head.weight.copy_(self.head_w[used].float())
            self.model.norm.weight.copy_(target.norm.weight.float())
        self.model.attach_target(target)
        coverage = float(counts[used].sum()) / float(counts.sum())
        print(f"specloom train: draft vocabulary {vd} tokens covers {coverage:.1%} of the data's tokens",
              file=sys.stderr)

    def loss(self, batch):
        m, a = self.model, self.args
        feats = torch.cat([batch["hidden"][i] for i in self.feature_ids], -1)
        final = batch["hidden"][self.L]
        tokens, valid = batch["tokens"], batch["valid"]
        total, metrics = 0.0, {}
        for j, h in m.ttt_forward(feats, tokens, valid, a.ttt_steps):
            ok = _shift(valid, 1 + j) & valid & _shift(m.t2d[tokens], 2 + j)  # x_{t+2+j} in the draft vocab
            rows = _sample_rows(ok, a.loss_fraction, self.gen)
            if rows.numel() == 0:
                continue
            hs = h.flatten(0, 1)[rows]
            tgt = self.target_logits(_shift(final, 1 + j).flatten(0, 1)[rows], self.used)
            logits = m.lm_head(m.norm(hs))
            lj = _soft_ce(logits, tgt).mean()
            total = total + (0.8 ** j) * lj
            metrics[f"acc{j}"] = float((logits.argmax(-1) == tgt.argmax(-1)).float().mean())
        return total, metrics

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("eagle3", self.model, path, {**meta, "draft_vocab_size": int(self.used.numel())},
                     verifier=self.args.target)


@trainer("eagle")
class Eagle1Trainer(_Base):
    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from .model import EagleDraftModel, eagle_config_for, init_weights

        self.feature_ids = (self.L,)
        self.model = EagleDraftModel(eagle_config_for(target.config, False, self.feature_ids))
        init_weights(self.model, args.seed)
        self.model.attach_target(target)

    def loss(self, batch):
        m, a = self.model, self.args
        final = batch["hidden"][self.L]
        tokens, valid = batch["tokens"], batch["valid"]
        total, metrics = 0.0, {}
        for j, h in m.ttt_forward(final, tokens, valid, a.ttt_steps):
            ok = _shift(valid, 1 + j) & valid
            tf = _shift(final, 1 + j).float()
            v = F.smooth_l1_loss(h.float(), tf, reduction="none").mean(-1)
            vloss = (v * ok).sum() / ok.sum().clamp(min=1)
            rows = _sample_rows(ok, a.loss_fraction, self.gen)
            hs, tgt = h.flatten(0, 1)[rows], self.target_logits(tf.flatten(0, 1)[rows])
            logits = self.target_logits(hs)
            ploss = _soft_ce(logits, tgt).mean()
            total = total + (0.8 ** j) * (vloss + a.token_weight * ploss)
            metrics[f"acc{j}"] = float((logits.argmax(-1) == tgt.argmax(-1)).float().mean())
        return total, metrics

    def target_logits(self, h, rows=None):
        return F.linear(h.to(self.head_w.dtype), self.head_w).float()

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("eagle", self.model, path, meta)
