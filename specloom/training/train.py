"""`specloom train {medusa,eagle,eagle3,draft_model}`: one training loop, one trainer per drafter kind.

Trainers register with `@trainer("kind")` and provide `model` (the same module class inference uses),
`loss(batch) -> (loss, metrics)` and `save(path, meta)`. The loop: frozen bf16 target (embedding and head only are
read), AdamW with warm-up + cosine decay, bf16 autocast on CPU, a seeded batch order, resumable checkpoints
(`train_state.pt` every `--save-every` steps: model, optimizer, step), a progress bar, a held-out evaluation of
per-step top-1 agreement with the target, and a loss-curve PNG.

Labels are the target's own: soft distributions from its head applied to the stored final hidden state
(EAGLE-3, EAGLE-1, Medusa, draft model), and its final features (EAGLE-1's regression target).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from ..errors import SpecloomError

TRAINERS: dict[str, type] = {}


def trainer(kind: str):
    def deco(cls):
        TRAINERS[kind] = cls
        cls.kind = kind
        return cls

    return deco


def _soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy against the target's soft distribution (rows, V)."""
    return -(torch.softmax(target_logits.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1)


def _sample_rows(mask: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Flat indices of a random `fraction` of the True entries of mask (at least one when any)."""
    idx = mask.flatten().nonzero().flatten()
    if fraction >= 1.0 or idx.numel() == 0:
        return idx
    n = max(1, int(idx.numel() * fraction))
    return idx[torch.randperm(idx.numel(), generator=gen)[:n]]


def to_device(batch: dict, device: torch.device) -> dict:
    """A collated batch (tokens, valid, loss_mask, hidden {id: ...}) on `device` (a no-op on the CPU)."""
    if device.type == "cpu":
        return batch
    return {k: ({c: t.to(device, non_blocking=True) for c, t in v.items()} if isinstance(v, dict)
                else v.to(device, non_blocking=True)) for k, v in batch.items()}


def train_device(args) -> torch.device:
    """`--device` (cpu, cuda, cuda:N; None: cuda when PyTorch sees a GPU) as a checked torch.device; callers that
    build `args` themselves without a `device` train on the CPU."""
    from ..loading import parse_device

    return parse_device(getattr(args, "device", "cpu"))


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] (zero/False past the end) along dim 1."""
    if n == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, n]
    return F.pad(x[:, n:], pad)


class _Base:
    kind = ""

    def __init__(self, target, tokenizer, data, args):
        self.target, self.tokenizer, self.data, self.args = target, tokenizer, data, args
        self.gen = torch.Generator().manual_seed(args.seed)
        self.L = target.config.num_layers
        self.head_w = target.lm_head.weight  # (V, H) frozen

    @classmethod
    def data_ids(cls, L: int) -> tuple[int, ...]:
        """Hidden-state ids (HF `hidden_states` convention) this trainer reads from the data; L = final state."""
        return (L,)

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def target_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        w = self.head_w if rows is None else self.head_w[rows]
        return (h.to(w.dtype) @ w.T).float()


@trainer("eagle3")
class Eagle3Trainer(_Base):
    @classmethod
    def data_ids(cls, L):
        from .selfdistill import eagle3_layer_ids

        return tuple(sorted({*eagle3_layer_ids(L), L}))

    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from ..drafters.eagle_model import EagleDraftModel, eagle_config_for, init_weights
        from .selfdistill import eagle3_layer_ids

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
        from ..drafters.checkpoint import save_drafter

        save_drafter("eagle3", self.model, path, {**meta, "draft_vocab_size": int(self.used.numel())},
                     verifier=self.args.target)


@trainer("eagle")
class Eagle1Trainer(_Base):
    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from ..drafters.eagle_model import EagleDraftModel, eagle_config_for, init_weights

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
        from ..drafters.checkpoint import save_drafter

        save_drafter("eagle", self.model, path, meta)


@trainer("medusa")
class MedusaTrainer(_Base):
    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from ..drafters.medusa import MedusaHeads

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
        from ..drafters.checkpoint import save_drafter

        save_drafter("medusa", self.model, path, {**meta, "target": self.args.target})


@trainer("draft_model")
class DraftModelTrainer(_Base):
    """A small LM with the target's tokenizer: the target's first `--draft-layers` layers, its final norm and
    (tied, frozen) embedding/head, distilled on the target's distributions. Saved as a HF Llama directory."""

    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        import dataclasses

        from ..loading.weights import build_model

        self.feature_ids = (self.L,)
        n = args.draft_layers or 2
        cfg = dataclasses.replace(target.config, num_layers=n)
        sd = {k: v.detach().float().clone() for k, v in target.state_dict().items()
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
        tgt = self.target_logits(batch["hidden"][self.L].flatten(0, 1)[rows])
        logits = self.target_logits(h.flatten(0, 1)[rows])
        loss = _soft_ce(logits, tgt).mean()
        return loss, {"acc0": float((logits.argmax(-1) == tgt.argmax(-1)).float().mean())}

    def target_logits(self, h, rows=None):
        return F.linear(h.to(self.head_w.dtype), self.head_w).float()

    def save(self, path, meta):
        save_hf_llama(self.model, path, meta)


def save_hf_llama(model, path: str, meta: dict) -> None:
    """Write a DecoderLM (Llama family) as a HF directory: config.json + model.safetensors (+ tokenizer later)."""
    from safetensors.torch import save_file

    c = model.config
    sd = {}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for k, v in model.state_dict().items():
        v = v.detach().cpu().to(torch.bfloat16)
        if k == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if "qkv_proj" in k:
            for name, part in zip("qkv", v.split([q, kv, kv], 0)):
                sd["model." + k.replace("qkv_proj", f"{name}_proj")] = part.contiguous()
        elif "gate_up_proj" in k:
            g, u = v.split(c.intermediate_size, 0)
            sd["model." + k.replace("gate_up_proj", "gate_proj")] = g.contiguous()
            sd["model." + k.replace("gate_up_proj", "up_proj")] = u.contiguous()
        elif k == "lm_head.weight":
            sd[k] = v.contiguous()
        else:
            sd["model." + k] = v.contiguous()
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
           "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position, "tie_word_embeddings": c.tie_word_embeddings,
           "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "specloom": meta}
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)


def _lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


@torch.no_grad()
def evaluate(tr, data, index, args, max_batches: int = 8) -> dict:
    sums, n = {}, 0
    dev = tr.target.device
    for b, batch in enumerate(data.batches(index, args.tokens_per_batch, seed=0)):
        if b >= max_batches:
            break
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss, metrics = tr.loss(to_device(batch, dev))
        for k, v in {"loss": float(loss), **metrics}.items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
    return {k: v / max(n, 1) for k, v in sums.items()}


def run_training(args) -> dict:
    from ..loading import load_target
    from ..drafters.checkpoint import specloom_meta
    from .dataset import DistillData

    if args.kind not in TRAINERS:
        raise SpecloomError(f"unknown drafter kind {args.kind!r} (choose from {', '.join(sorted(TRAINERS))})")
    if getattr(TRAINERS[args.kind], "standalone", False):  # `train target`: its own loop, nothing frozen
        return TRAINERS[args.kind].run(args)
    dev = train_device(args)
    torch.manual_seed(args.seed)
    target, tokenizer = load_target(args.target, "bf16", pack=False, device=dev)
    L = target.config.num_layers
    ids = tuple(sorted({*TRAINERS[args.kind].data_ids(L), L}))
    data = DistillData(args.data, ids, max_tokens=args.max_data_tokens)
    fp = data.meta.get("fingerprint", {})
    from ..fingerprint import compare, fingerprint

    diff = compare(fp, fingerprint(target, tokenizer))
    if diff:
        raise SpecloomError(f"{' '.join(args.data)} was generated with another target ({'; '.join(diff)} differ)")
    train_idx, eval_idx = data.split(args.eval_fraction, args.seed)
    print(f"specloom train {args.kind}: {data.num_tokens} tokens in {len(data.seqs)} sequences "
          f"({len(eval_idx)} held out)", file=sys.stderr, flush=True)
    tr = TRAINERS[args.kind](target, tokenizer, data, args)
    tr.model.to(dev)  # built on the CPU (the draft model trainer's: already on the target's device)
    if args.init_from:
        _init_from(tr, args.init_from)
    params = tr.parameters()
    print(f"specloom train {args.kind}: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters",
          file=sys.stderr, flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    os.makedirs(args.out, exist_ok=True)
    state_path = os.path.join(args.out, "train_state.pt")
    batches_per_epoch = len(data.groups(train_idx, args.tokens_per_batch, 0))
    total = args.steps or batches_per_epoch * args.epochs
    step, history = 0, []
    if os.path.isfile(state_path):
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        tr.model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, history = st["step"], st["history"]
        tr.gen.set_state(st["gen"])
        print(f"specloom train: resuming at step {step}/{total}", file=sys.stderr, flush=True)
    if hasattr(tr, "used"):  # a resumed / initialised EAGLE-3 keeps its own draft vocabulary
        tr.used = torch.arange(tr.model.d2t.numel()) + tr.model.d2t
    from tqdm import tqdm

    bar = tqdm(total=total, initial=step, desc=f"train {args.kind}", file=sys.stderr, mininterval=2.0)
    t0 = time.perf_counter()
    epoch = step // max(batches_per_epoch, 1)
    while step < total:
        skip = step - epoch * batches_per_epoch
        for group in data.groups(train_idx, args.tokens_per_batch, seed=args.seed + epoch)[max(skip, 0):]:
            if step >= total:
                break
            batch = to_device(data.collate(group, 1024), dev)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total, args.lr, args.warmup)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss, metrics = tr.loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            step += 1
            history.append({"step": step, "loss": float(loss), **metrics})
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", **{k: f"{v:.2f}" for k, v in metrics.items()})
            if step % args.save_every == 0 or step == total:
                torch.save({"model": tr.model.state_dict(), "opt": opt.state_dict(), "step": step,
                            "history": history, "gen": tr.gen.get_state()}, state_path + ".tmp")
                os.replace(state_path + ".tmp", state_path)
        epoch += 1
    bar.close()
    wall = time.perf_counter() - t0
    tr.model.eval()
    ev = evaluate(tr, data, eval_idx, args)
    print(f"specloom train {args.kind}: held-out " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()),
          file=sys.stderr, flush=True)
    meta = specloom_meta(args.kind, target, tokenizer, tr.feature_ids, manifest={
        "command": " ".join(["specloom", "train"] + sys.argv[2:]) if sys.argv[1:2] == ["train"] else args.command,
        "data": args.data, "data_tokens": data.num_tokens,
        "data_meta": [{k: m.get(k) for k in ("target", "num_prompts", "max_new_tokens", "prompt_files")}
                      for m in data.metas],
        "steps": step, "seed": args.seed, "lr": args.lr, "ttt_steps": args.ttt_steps,
        "train_seconds_this_run": round(wall, 1), "held_out": ev,
    })
    if args.kind == "medusa":
        meta["topk_accuracy"] = topk_accuracy_medusa(tr, data, eval_idx, args)
    tr.save(args.out, meta)
    if args.kind == "draft_model":
        tokenizer.hf.save_pretrained(args.out)
    _plot_losses(history, os.path.join(args.out, "loss.png"), args.kind)
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(history, f)
    return {"held_out": ev, "steps": step}


@torch.no_grad()
def topk_accuracy_medusa(tr, data, index, args, max_batches: int = 4) -> list[list[float]]:
    """Per head, the fraction of rows whose target argmax is the head's rank-r candidate (for tree building)."""
    from ..drafters.medusa import TOPK

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


def _init_from(tr, path: str) -> None:
    from ..drafters.checkpoint import load_drafter

    if tr.kind == "draft_model":
        from ..loading import load_target

        m, _ = load_target(path, "fp32", pack=False, progress=False)
        tr.model.load_state_dict(m.state_dict(), strict=False)
        return
    model, _ = load_drafter(path, tr.kind, tr.target, tr.tokenizer)
    own = tr.model.state_dict()
    tr.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items()
                              if k in own})


def _plot_losses(history: list[dict], path: str, kind: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not history:
        return
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    w = max(1, len(history) // 50)

    def smooth(v):
        return [sum(v[max(0, i - w + 1):i + 1]) / len(v[max(0, i - w + 1):i + 1]) for i in range(len(v))]

    ax[0].plot(steps, smooth([h["loss"] for h in history]))
    ax[0].set_title(f"{kind}: training loss")
    ax[0].set_xlabel("step")
    for key in sorted(k for k in history[-1] if k.startswith("acc")):
        ax[1].plot(steps, smooth([h.get(key, float("nan")) for h in history]), label=f"step {key[3:]}")
    ax[1].set_title("top-1 agreement with the target (train batches)")
    ax[1].set_xlabel("step")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


from . import train_block, train_mtp, train_target  # noqa: E402,F401  (trainer registration)
