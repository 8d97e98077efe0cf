"""Trainers for EAGLE-3 and EAGLE-1 (`specloom train eagle3|eagle`): the training-time test over the network
in model.py, labels from the target's head."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ...training.common import _Base, _sample_rows, _shift, _soft_ce, draft_vocabulary
from ..base import trainer
from ...training.options import draft_vocabulary_options, option, positive_int, warm_start_option
from ...training.distributed import shard_mean, total_rows


def warm_start(model, target, layer: int) -> None:
    """Start the EAGLE-3 layer from target layer `layer` (negative: from the end): attention (its input
    projections on the hidden half of [embedding; hidden]), MLP and norms copied, and `fc` picking the last
    feature (the target's high layer); the embedding half of the projections stays at its small random init."""
    from ...training.warm_start import copy_layer, pick_last_feature, start_layer

    dst = model.layers[0]
    H = model.config.hidden_size
    copy_layer(dst, target.layers[start_layer(target, layer)], dst.hidden_norm, slice(H, None))
    pick_last_feature(model.fc, H)


def add_arguments(t) -> None:
    """`specloom train eagle | eagle3` options."""
    option(t, "--ttt-steps", type=positive_int, default=3, help="training-time-test unroll (eagle, eagle3)")
    option(t, "--token-weight", type=float, default=0.5, help="eagle: weight of the token loss")
    option(t, "--eagle31", action="store_true",
           help="eagle3: EAGLE-3.1's norms -- one RMSNorm per captured feature before fc, and the drafted rows fed "
                "norm(h) (speculators' fc_norm + norm_output; vLLM reads them)")
    draft_vocabulary_options(t)
    warm_start_option(t)


@trainer("eagle3")
class Eagle3Trainer(_Base):
    arg_defaults = {}  # --draft-vocab: 8192, or with --init-from and no vocabulary option the source's own

    @classmethod
    def data_ids(cls, L):
        from .model import eagle3_layer_ids

        return tuple(sorted({*eagle3_layer_ids(L), L}))

    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from .model import EagleDraftModel, eagle_config_for, init_weights
        from .model import eagle3_layer_ids

        self.feature_ids = eagle3_layer_ids(self.L)
        used, coverage = self._vocabulary(data, args, target, tokenizer)
        vd = used.numel()
        cfg = eagle_config_for(target.config, True, self.feature_ids, vd)
        cfg.fc_norm = cfg.norm_output = bool(getattr(args, "eagle31", False))  # EAGLE-3.1's two norms
        self.model = EagleDraftModel(cfg)
        init_weights(self.model, args.seed)
        layer = getattr(args, "warm_start_layer", None)
        if layer is not None:
            warm_start(self.model, target, layer)
        self.model.d2t.copy_(used - torch.arange(vd))
        self.model.t2d.zero_()
        self.model.t2d[used] = True
        self.used = used
        with torch.no_grad():  # speculators' recipe: start the draft head from the target's rows
            self.model.lm_head.weight.copy_(self.head_w[used].float())
            self.model.norm.weight.copy_(target.norm.weight.float())
        self.model.attach_target(target)
        self.coverage = coverage
        print(f"specloom train: draft vocabulary {vd} tokens covers {coverage:.1%} of the answer tokens",
              file=sys.stderr)

    def _vocabulary(self, data, args, target, tokenizer) -> tuple[torch.Tensor, float]:
        """The draft vocabulary (sorted target ids) and its share of the answer tokens. Continuing a drafter
        (--init-from) with neither --draft-vocab nor --draft-vocab-coverage keeps that drafter's own vocabulary,
        so every head row carries over (re-choosing it on grown data had moved ~900 of 4,864 rows and restarted
        held-out top-1 agreement near 0.2 instead of 0.59); otherwise the most frequent answer tokens."""
        cap, cov = args.draft_vocab, getattr(args, "draft_vocab_coverage", None)
        fixed = None
        if getattr(args, "init_from", None) and cap is None and cov is None:
            from ...drafters.checkpoint import load_drafter

            src, _ = load_drafter(args.init_from, self.kind, target, tokenizer)
            fixed = torch.arange(src.d2t.numel()) + src.d2t.cpu()
        return draft_vocabulary(data, target.config.vocab_size, cap or 8192, cov, fixed=fixed)

    def init_from(self, path: str) -> None:
        """Start from an EAGLE-3 checkpoint whose draft vocabulary may differ from this run's: every tensor of the
        same shape is copied, and the draft head's rows for tokens in both vocabularies (the rest start from the
        mean of those); this run's vocabulary (d2t, t2d) is kept."""
        from ...drafters.checkpoint import load_drafter
        from ...errors import SpecloomError

        src, _ = load_drafter(path, self.kind, self.target, self.tokenizer)
        theirs = src.state_dict()
        own = self.model.state_dict()
        mismatched = [k for k, v in theirs.items() if k in own and k not in ("d2t", "t2d", "lm_head.weight")
                      and v.shape != own[k].shape]
        if mismatched:
            raise SpecloomError(f"--init-from {path}: its {', '.join(mismatched)} do not match this draft model's "
                                "shapes (another hidden size or feature layers)")
        with torch.no_grad():
            for k, v in theirs.items():
                if k in own and k not in ("d2t", "t2d", "lm_head.weight"):
                    own[k].copy_(v.float() if v.is_floating_point() else v)
            their_used = torch.arange(src.d2t.numel()) + src.d2t.cpu()
            row = torch.full((self.target.config.vocab_size,), -1, dtype=torch.long)
            row[their_used] = torch.arange(their_used.numel())
            hit = row[self.used.cpu()]
            keep = hit >= 0
            head = own["lm_head.weight"]
            head[keep] = theirs["lm_head.weight"][hit[keep]].float().to(head.device)
            if keep.any() and not keep.all():
                # a token new to the vocabulary starts from the mean carried row (an average logit), not the
                # target's row: those outscored the trained rows and restarted top-1 agreement near 0.2
                head[~keep] = head[keep].mean(0)
        print(f"specloom train: initialised from {path} ({int(keep.sum())} of {keep.numel()} draft-head rows "
              "carried over" + ("" if keep.all() else ", the rest start from their mean") + ")", file=sys.stderr)

    def loss(self, batch):
        m, a = self.model, self.args
        feats = torch.cat([batch["hidden"][i] for i in self.feature_ids], -1)
        final = batch["hidden"][self.L]
        tokens, valid = batch["tokens"], batch["valid"]
        total, metrics = 0.0, {}
        for j, h in m.ttt_forward(feats, tokens, valid, a.ttt_steps):
            ok = _shift(valid, 1 + j) & valid & _shift(m.t2d[tokens], 2 + j)  # x_{t+2+j} in the draft vocab
            rows = _sample_rows(ok, a.loss_fraction, self.gen)
            n = total_rows(rows.numel())  # over all processes' shares of the batch (training/distributed.py)
            if n == 0:
                continue
            hs = h.flatten(0, 1)[rows]
            tgt = self.target_logits(_shift(final, 1 + j).flatten(0, 1)[rows], self.used)
            logits = m.lm_head(m.norm(hs))
            lj = shard_mean(_soft_ce(logits, tgt), n)
            total = total + (0.8 ** j) * lj
            metrics[f"acc{j}"] = float(shard_mean((logits.argmax(-1) == tgt.argmax(-1)).float(), n))
        return total, metrics

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("eagle3", self.model, path, {**meta, "draft_vocab_size": int(self.used.numel()),
                                                   "draft_vocab_coverage": round(getattr(self, "coverage", 0.0), 4),
                                                   "warm_start_layer": getattr(self.args, "warm_start_layer", None)},
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
            vloss = (v * ok).sum() / max(total_rows(int(ok.sum())), 1)  # counts over all processes' shares
            rows = _sample_rows(ok, a.loss_fraction, self.gen)
            n = total_rows(rows.numel())
            hs, tgt = h.flatten(0, 1)[rows], self.target_logits(tf.flatten(0, 1)[rows])
            logits = self.target_logits(hs)
            ploss = shard_mean(_soft_ce(logits, tgt), n)
            total = total + (0.8 ** j) * (vloss + a.token_weight * ploss)
            metrics[f"acc{j}"] = float(shard_mean((logits.argmax(-1) == tgt.argmax(-1)).float(), n))
        return total, metrics

    def target_logits(self, h, rows=None):
        return F.linear(h.to(self.head_w.dtype), self.head_w).float()

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("eagle", self.model, path, meta)
