"""`specloom train mtp`: post-hoc MTP layers for a frozen target, saved in the DeepSeek-V3 layout.

Module i at row t reads h^{i-1}_t (module 0: the target's final hidden state) and token x_{t+1+i}, and learns the
target's own distribution for x_{t+2+i} (soft labels from its head over the stored final state at t+1+i), weighted
0.8^i over modules. Each module's block and shared-head norm start from the target's last layer and final norm.

Output (`--out`): an overlay checkpoint (config.json declaring `num_nextn_predict_layers` + `model-mtp.safetensors`
with `model.layers.{L+i}.*`), usable as `{"method": "mtp", "model": OUT}`; with `--target-copy DIR`, also a full
HF copy of the target with the MTP layers inside (the layout `method: "mtp"` reads from the target itself).
"""

from __future__ import annotations

import sys

from ...training.common import _Base, _sample_rows, _shift, _soft_ce, save_hf_llama
from ...errors import SpecloomError
from ..base import trainer
from ...training.distributed import shard_mean, total_rows


@trainer("mtp")
class MTPTrainer(_Base):
    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from .model import MTPModel, init_mtp

        self.feature_ids = (self.L,)
        self.model = MTPModel(target.config, args.mtp_layers)
        init_mtp(self.model, target, args.seed)
        self.model.float()
        self.model.attach_target(target)

    def loss(self, batch):
        m = self.model
        final = batch["hidden"][self.L]
        tokens, valid = batch["tokens"], batch["valid"]
        total, metrics = 0.0, {}
        for i, h in m.train_forward(final, tokens, valid):
            ok = _shift(valid, 1 + i) & valid  # the target's distribution for x_{t+2+i} sits at row t+1+i
            rows = _sample_rows(ok, self.args.loss_fraction, self.gen)
            n = total_rows(rows.numel())  # over all processes' shares of the batch (training/distributed.py)
            if n == 0:
                continue
            tgt = self.target_logits(_shift(final, 1 + i).flatten(0, 1)[rows])
            logits = m.logits(i, h.flatten(0, 1)[rows])
            total = total + (0.8 ** i) * shard_mean(_soft_ce(logits, tgt), n)
            metrics[f"acc{i}"] = float(shard_mean((logits.argmax(-1) == tgt.argmax(-1)).float(), n))
        return total, metrics

    def init_from(self, path: str) -> None:
        """Start from an MTP checkpoint (an overlay directory or a target with its MTP layers): every module it
        has, copied in fp32 (a checkpoint with fewer modules leaves the rest as initialised)."""
        from .format import find_mtp_dir, load_mtp

        src, _ = load_mtp(find_mtp_dir(path, self.target.config), self.target)
        own = self.model.state_dict()
        theirs = {k: v for k, v in src.state_dict().items() if k in own}
        if not theirs:
            raise SpecloomError(f"--init-from {path}: no MTP layer of it fits this model")
        self.model.load_state_dict({k: v.float() for k, v in theirs.items()}, strict=False)

    def target_logits(self, h, rows=None):
        return self.target.logits(h.to(self.head_w.dtype))

    def save(self, path, meta):
        from .format import save_into_target, save_overlay

        meta = {**meta, "depth": self.model.num_layers}
        save_overlay(self.model, path, meta)
        copy = getattr(self.args, "target_copy", None)
        if copy:
            print(f"specloom train mtp: writing a copy of the target with its MTP layers to {copy}",
                  file=sys.stderr, flush=True)
            save_hf_llama(self.target, copy, {})
            self.tokenizer.hf.save_pretrained(copy)
            save_into_target(self.model, copy, meta)


def add_arguments(t) -> None:
    t.add_argument("--mtp-layers", type=int, default=1, help="mtp: number of MTP modules (draft depth)")
    t.add_argument("--target-copy", default=None,
                   help="mtp: also write a HF copy of the target with the MTP layers inside (DeepSeek layout)")
