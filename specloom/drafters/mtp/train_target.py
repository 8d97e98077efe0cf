"""`specloom train target --mtp N`: a small Llama-family target trained from scratch jointly with N MTP modules.

This is what "MTP trained with the target" means (DeepSeek-V3): the main next-token loss plus lambda times the
mean of the MTP modules' losses, with gradients of both flowing into the trunk, so the trunk learns features that
also serve the modules. Labels are the corpus tokens (hard cross-entropy): module i at row t predicts x_{t+2+i}
from the trunk's final state and x_{t+1+i} (drafters.md §4.1, rows as in `MTPModel.train_forward`).

Corpus: the token ids of `specloom data` directories (prompts and answers; any target's data made with the same
tokenizer). The tokenizer and its vocabulary come from `--target` (e.g. smollm2-135m); the new model's shape from
`--model-layers/--model-hidden/--model-heads/--model-kv-heads/--model-intermediate`. Output: a HF directory (the
target, its tokenizer, and the MTP layers inside in the DeepSeek layout), servable as
`specloom generate OUT --speculative-config '{"method": "mtp"}'`. No resume: runs are minutes long.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from ...errors import SpecloomError
from ...training.common import _plot_losses, _shift, save_hf_llama
from ...training.fit import epoch_batches, fit
from ..base import trainer

MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens


@trainer("target", of="mtp")
class TargetTrainer:
    standalone = True  # has its own loop: nothing is frozen, no distillation data needed

    @staticmethod
    def run(args) -> dict:
        if args.init_from:  # fine-tune an existing target instead of training a new one
            from ...training.finetune import finetune

            return finetune(args)
        from ...config import ModelConfig
        from .model import MTPModel, init_mtp
        from ...loading import load_config, resolve
        from ...models import FAMILIES
        from ...tokenizer import Tokenizer
        from ...training.dataset import DistillData
        from ...training.common import to_device, train_device

        dev = train_device(args)
        torch.manual_seed(args.seed)
        src = resolve(args.target)
        base, _ = load_config(src)
        tok = (Tokenizer.from_gguf(src.path, base.eos_token_ids) if src.kind == "gguf"
               else Tokenizer.from_dir(src.path, base.eos_token_ids))
        H, heads = args.model_hidden, args.model_heads
        if H % heads:
            raise SpecloomError(f"--model-hidden {H} is not a multiple of --model-heads {heads}")
        kv_heads = args.model_kv_heads or heads
        if heads % kv_heads:
            raise SpecloomError(f"--model-heads {heads} is not a multiple of --model-kv-heads {kv_heads}")
        cfg = ModelConfig(model_type="llama", vocab_size=base.vocab_size, hidden_size=H,
                          intermediate_size=args.model_intermediate or 3 * H, num_layers=args.model_layers,
                          num_heads=heads, num_kv_heads=kv_heads, head_dim=H // heads, rms_norm_eps=1e-5,
                          rope_theta=10000.0, max_position=2048, tie_word_embeddings=True,
                          bos_token_id=base.bos_token_id, eos_token_ids=base.eos_token_ids)
        model = FAMILIES["llama"](cfg)
        g = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02)
        mtp = MTPModel(cfg, args.mtp)
        init_mtp(mtp, seed=args.seed)
        model.to(dev)
        mtp.to(dev)
        mtp.attach_target(model)
        data = DistillData(args.data, (), max_tokens=args.max_data_tokens)
        train_idx, eval_idx = data.split(args.eval_fraction)
        params = list(model.parameters()) + list(mtp.parameters())
        n_trunk = sum(p.numel() for p in model.parameters())
        print(f"specloom train target: {n_trunk / 1e6:.1f}M-parameter model ({args.model_layers} layers, hidden {H}) "
              f"+ {args.mtp} MTP module(s) ({sum(p.numel() for p in mtp.parameters()) / 1e6:.1f}M), "
              f"{data.num_tokens} corpus tokens", file=sys.stderr, flush=True)
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
        per_epoch = len(data.groups(train_idx, args.tokens_per_batch, 0, 512))
        total = args.steps or per_epoch * args.epochs
        from tqdm import tqdm

        bar = tqdm(total=total, desc="train target+mtp", file=sys.stderr, mininterval=2.0)
        history, step, t0 = [], 0, time.perf_counter()
        model.train()
        batches = epoch_batches(lambda epoch: data.groups(train_idx, args.tokens_per_batch, args.seed + epoch, 512),
                                lambda group: to_device(data.collate(group, 512), dev), per_epoch)
        for step, _, loss, metrics in fit(opt, params, batches,
                                          lambda batch: joint_loss(model, mtp, batch, args.loss_fraction, g),
                                          total=total, lr=args.lr, warmup=args.warmup, device=dev, bf16=args.bf16,
                                          clip=1.0):
            history.append({"step": step, "loss": float(loss), **metrics})
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", **{k: f"{v:.2f}" for k, v in metrics.items()})
        bar.close()
        model.eval()
        mtp.eval()
        with torch.no_grad():
            ev = [joint_loss(model, mtp, to_device(b, dev), 1.0, g)[1]
                  for _, b in zip(range(8), data.batches(eval_idx, 4096, 0, 512))]
        held = {k: sum(e[k] for e in ev) / len(ev) for k in ev[0]} if ev else {}
        print("specloom train target: held-out " + ", ".join(f"{k} {v:.3f}" for k, v in held.items()),
              file=sys.stderr, flush=True)
        from ..checkpoint import specloom_meta
        from .format import save_into_target

        manifest = {"command": " ".join(["specloom"] + sys.argv[1:]), "data": args.data,
                    "data_tokens": data.num_tokens, "steps": step, "seed": args.seed, "lr": args.lr,
                    "mtp_loss_weight": MTP_LOSS_WEIGHT, "train_seconds": round(time.perf_counter() - t0, 1),
                    "held_out": held}
        model.to(torch.bfloat16)
        mtp.to(torch.bfloat16)
        save_hf_llama(model, args.out, {"kind": "target", "manifest": manifest})
        tok.hf.save_pretrained(args.out)
        save_into_target(mtp, args.out, {**specloom_meta("mtp", model, tok, (cfg.num_layers,)),
                                         "trained_with_target": True, "depth": args.mtp, "manifest": manifest})
        _plot_losses(history, os.path.join(args.out, "loss.png"), "target+mtp")
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f)
        return {"held_out": held, "steps": step}


def joint_loss(model, mtp, batch, fraction: float, gen: torch.Generator):
    """Main next-token CE + MTP_LOSS_WEIGHT * mean over modules of their CE (hard labels, sampled rows)."""
    tokens, valid = batch["tokens"], batch["valid"]
    B, T = tokens.shape
    L = model.config.num_layers
    kv = model.new_kv(T, dtype=torch.float32, batch=B)
    dev = tokens.device
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :]
    mask |= torch.eye(T, dtype=torch.bool, device=dev)[None]
    final = model(tokens, pos, kv, attn_mask=mask, capture=(L,), num_logits=0).hidden[L]
    metrics = {}

    def ce(logits_fn, h, shift: int, name: str):
        ok = (_shift(valid, shift) & valid).flatten()
        idx = ok.nonzero().flatten()
        if fraction < 1.0 and idx.numel():
            idx = idx[torch.randperm(idx.numel(), generator=gen)[:max(1, int(idx.numel() * fraction))]]
        logits = logits_fn(h.flatten(0, 1)[idx])
        labels = _shift(tokens, shift).flatten()[idx]
        metrics[name] = float((logits.argmax(-1) == labels).float().mean())
        return F.cross_entropy(logits.float(), labels)

    main = ce(model.logits, final, 1, "acc_main")
    extra = [ce(lambda x, i=i: mtp.logits(i, x), h, 2 + i, f"acc{i}") for i, h in mtp.train_forward(final, tokens, valid)]
    loss = main + (MTP_LOSS_WEIGHT * sum(extra) / len(extra) if extra else 0.0)
    return loss, metrics


def add_arguments(t) -> None:
    t.add_argument("--mtp", type=int, default=1, help="target: MTP modules trained jointly with the new model")
    t.add_argument("--model-layers", type=int, default=6, help="target: decoder layers of the new model")
    t.add_argument("--model-hidden", type=int, default=256, help="target: hidden size of the new model")
    t.add_argument("--model-heads", type=int, default=4, help="target: attention heads")
    t.add_argument("--model-kv-heads", type=int, default=None, help="target: KV heads (default: = heads)")
    t.add_argument("--train-layers", type=int, default=None,
                   help="target --init-from: train only the last K decoder layers (default: all of them)")
    t.add_argument("--model-intermediate", type=int, default=None, help="target: MLP width (default 3x hidden)")
