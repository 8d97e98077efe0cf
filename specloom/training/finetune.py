"""`specloom train target --init-from MODEL`: supervised fine-tuning of an existing Llama-family target.

The model `--init-from` names (alias, .gguf or HF directory) is read in fp32 and trained with next-token
cross-entropy on the answer tokens (loss masks) of `specloom data` directories — any data made with the same
tokenizer, e.g. answers rewritten into a persona (scripts/make_persona_data.py). The embedding, the output head and
the final norm stay frozen (`--train-layers K`: also every decoder layer but the last K), so the structural
fingerprint of the fine-tune equals the original's: the case only the behavioural fingerprint can see.

Output: a HF directory (config.json with the run's manifest under `specloom`, bf16 model.safetensors, the
tokenizer with its chat template) that every specloom command takes as a target. No resume: runs are minutes.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

from ..errors import SpecloomError
from .common import _plot_losses, save_hf_llama, to_device, train_device
from .fit import epoch_batches, fit


def answer_loss(model, batch) -> tuple[torch.Tensor, dict]:
    """Mean next-token cross-entropy over the answer tokens (a token counts where its own loss mask is set)."""
    tokens, valid, mask = batch["tokens"], batch["valid"], batch["loss_mask"]
    B, T = tokens.shape
    L = model.config.num_layers
    dev = tokens.device
    kv = model.new_kv(T, dtype=torch.float32, batch=B)
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    attn = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :]
    attn |= torch.eye(T, dtype=torch.bool, device=dev)[None]
    final = model(tokens, pos, kv, attn_mask=attn, capture=(L,), num_logits=0).hidden[L]
    rows = mask[:, 1:] & valid[:, 1:]  # row t predicts token t + 1
    h = final[:, :-1][rows]
    labels = tokens[:, 1:][rows]
    if not labels.numel():
        return final.sum() * 0.0, {"acc": 0.0}
    logits = model.logits(h)
    return F.cross_entropy(logits, labels), {"acc": float((logits.argmax(-1) == labels).float().mean())}


def _trainable(model, train_layers: int | None) -> list[torch.nn.Parameter]:
    L = model.config.num_layers
    first = 0 if not train_layers else max(0, L - train_layers)
    keep = {f"layers.{i}." for i in range(first, L)}
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(any(name.startswith(k) for k in keep))
        if p.requires_grad:
            params.append(p)
    return params


@torch.no_grad()
def _held_out(model, data, index, dev, batches: int = 8) -> dict:
    out = [answer_loss(model, to_device(b, dev)) for _, b in zip(range(batches), data.batches(index, 4096, 0, 512))]
    if not out:
        return {}
    return {"loss": sum(float(l) for l, _ in out) / len(out), "acc": sum(m["acc"] for _, m in out) / len(out)}


def finetune(args) -> dict:
    from ..loading import load_target, resolve
    from ..models import FAMILIES
    from ..tokenizer import Tokenizer
    from .dataset import DistillData

    dev = train_device(args)
    torch.manual_seed(args.seed)
    model, tok = load_target(args.init_from, "fp32", pack=False, device=dev)
    if type(model) is not FAMILIES["llama"]:
        raise SpecloomError(f"--init-from {args.init_from}: fine-tuning writes Llama-family HF directories; this "
                            f"model is {model.config.model_type}")
    if getattr(model, "quant_modules", None):
        raise SpecloomError(f"--init-from {args.init_from}: a model held quantized cannot be fine-tuned")
    data = DistillData(args.data, (), max_tokens=args.max_data_tokens)
    vocab = model.config.vocab_size
    if max(int(t.max()) for t, _, _ in data.seqs) >= vocab:
        raise SpecloomError(f"{' '.join(args.data)} holds token ids beyond {args.init_from}'s vocabulary of {vocab}: "
                            "made with another tokenizer")
    train_idx, eval_idx = data.split(args.eval_fraction)
    params = _trainable(model, getattr(args, "train_layers", None))
    print(f"specloom train target: fine-tuning {args.init_from}: {sum(p.numel() for p in params) / 1e6:.1f}M of "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters trainable, "
          f"{data.num_answer_tokens} answer tokens ({len(eval_idx)} sequences held out)", file=sys.stderr, flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = len(data.groups(train_idx, args.tokens_per_batch, 0, 512))
    total = args.steps or per_epoch * args.epochs
    model.eval()
    before = _held_out(model, data, eval_idx, dev)
    print(f"specloom train target: held-out before: loss {before.get('loss', 0):.3f}, top-1 {before.get('acc', 0):.3f}",
          file=sys.stderr, flush=True)
    from tqdm import tqdm

    bar = tqdm(total=total, desc="fine-tune target", file=sys.stderr, mininterval=2.0)
    history, step, t0 = [], 0, time.perf_counter()
    limit = getattr(args, "max_minutes", None)
    model.train()
    batches = epoch_batches(lambda epoch: data.groups(train_idx, args.tokens_per_batch, args.seed + epoch, 512),
                            lambda group: to_device(data.collate(group, 512), dev), per_epoch,
                            stop=lambda: bool(limit) and time.perf_counter() - t0 > 60 * limit)
    for step, _, loss, metrics in fit(opt, params, batches, lambda batch: answer_loss(model, batch), total=total,
                                      lr=args.lr, warmup=args.warmup, device=dev, bf16=args.bf16, clip=1.0):
        history.append({"step": step, "loss": float(loss), **metrics})
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{metrics['acc']:.2f}")
    bar.close()
    wall = time.perf_counter() - t0
    model.eval()
    after = _held_out(model, data, eval_idx, dev)
    print(f"specloom train target: held-out after {step} steps ({wall / 60:.1f} min): loss {after.get('loss', 0):.3f}, "
          f"top-1 {after.get('acc', 0):.3f}", file=sys.stderr, flush=True)
    manifest = {"command": " ".join(["specloom"] + sys.argv[1:]), "fine_tuned_from": args.init_from,
                "data": args.data, "answer_tokens": data.num_answer_tokens, "steps": step, "seed": args.seed,
                "lr": args.lr, "train_layers": getattr(args, "train_layers", None), "train_seconds": round(wall, 1),
                "held_out_before": before, "held_out_after": after}
    os.makedirs(args.out, exist_ok=True)
    save_hf_llama(model, args.out, {"kind": "target", "manifest": manifest})
    src = resolve(args.init_from)
    if src.kind == "gguf":
        Tokenizer.from_gguf(src.path, model.config.eos_token_ids).hf.save_pretrained(args.out)
    else:
        tok.hf.save_pretrained(args.out)
    _plot_losses(history, os.path.join(args.out, "loss.png"), "fine-tune")
    from ..atomic import write_json

    write_json(os.path.join(args.out, "history.json"), history)
    return {"held_out": after, "held_out_before": before, "steps": step}
