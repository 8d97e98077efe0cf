"""What every drafter trainer shares: the base trainer, soft cross-entropy against the target, row
sampling, shifting, the learning-rate schedule, the loss plot and the HF Llama writer. Kind trainers live with their
kind (drafters/<kind>/trainer.py) and register in their kind's record with `@trainer("kind")` (drafters/base.py);
`jobs/train.py` runs the loop.

A trainer's means over rows (losses and metrics) go through `distributed.total_rows` + `shard_mean`: under torchrun
each process holds a share of the batch, and these make the processes' partial losses add up to the one-process
loss (in one process they are plain means)."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

def _soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy against the target's soft distribution (rows, V)."""
    return -(torch.softmax(target_logits.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1)


def draft_vocab_size(counts: torch.Tensor, cap: int, coverage: float | None) -> int:
    """The draft vocabulary: `cap` tokens, or with `coverage`, the fewest most frequent tokens (a multiple of 256,
    at most `cap`) that cover that share of the answer tokens."""
    if coverage is None:
        return cap
    if not 0.0 < coverage <= 1.0:
        from ..errors import SpecloomError

        raise SpecloomError(f"--draft-vocab-coverage must lie in (0, 1], got {coverage}")
    c = counts.sort(descending=True).values.cumsum(0).double()
    need = int((c < coverage * c[-1]).sum()) + 1
    return max(256, min(cap, -(-need // 256) * 256))


def answer_counts(data, vocab_size: int, index=None) -> torch.Tensor:
    """Counts (V,) of the answer tokens of `data`'s sequences (`index`: those only; default all): the tokens a
    drafter must predict, the target's own outputs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(data.seqs)) if index is None else index:
        t, m, _ = data.seqs[i]
        counts += torch.bincount(t[m], minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(data, vocab_size: int, cap: int | None, coverage: float | None,
                     fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """A reduced draft vocabulary (EAGLE-3 `d2t`, Medusa `token_map`): the sorted ids of the most frequent answer
    tokens of `data` (`--draft-vocab` = `cap`, None: the whole vocabulary; `--draft-vocab-coverage`, see
    `draft_vocab_size`), or the sorted ids `fixed` when given; and the share of the answer tokens they cover."""
    counts = answer_counts(data, vocab_size)
    if fixed is not None:
        used = fixed.sort().values
    else:
        vd = draft_vocab_size(counts, min(cap or vocab_size, vocab_size), coverage)
        used = counts.topk(vd).indices.sort().values
    return used, float(counts[used].sum()) / float(counts.sum().clamp(min=1))


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
    arg_defaults: dict = {}  # options whose default depends on the kind (`run_training` fills them in when None)

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

    def extra_meta(self, data, index) -> dict:
        """Facts measured on the held-out rows that the checkpoint keeps (Medusa: per-head top-k accuracy)."""
        return {}


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


def optimizer_step(opt, params: list, loss: torch.Tensor, clip: float, sync=None) -> None:
    """One optimizer step: zero the gradients, back-propagate `loss`, `sync(params)` when given (under torchrun:
    `distributed.sync_grads`), clip the gradient norm of `params` to `clip`, step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if sync is not None:
        sync(params)
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def _lr_at(step: int, total: int, lr: float, warmup: int, time_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 0.1 x lr over the remaining steps -- or over the remaining time, where
    `time_frac` (the share of a time budget spent: `--anneal-by-time`) is further along."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = max((step - warmup) / max(1, total - warmup), time_frac)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


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


