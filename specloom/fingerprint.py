"""A target's fingerprint, recorded in every drafter checkpoint and dataset we write.

A drafter reads the target's hidden states and shares its embedding and head: one trained for another copy of
the model (other weights, other vocabulary) drafts nonsense that verification then rejects — slow, never wrong.
The fingerprint names what must match: architecture and shapes, a hash of the vocabulary, and hashes of the
embedding and LM head (taken in bf16, so an fp32 and a bf16 load of the same checkpoint agree). A change that
leaves these alone (a fine-tune of the inner layers, a re-quantization) is for the behavioural fingerprint
(behaviour.py: the target's predictions on a fixed probe) to see.
"""

from __future__ import annotations

import hashlib
import logging

import torch

log = logging.getLogger("specloom")


def _tensor_sha(t: torch.Tensor) -> str:
    data = t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return hashlib.sha1(data).hexdigest()[:16]


def vocab_sha(tokenizer) -> str | None:
    if tokenizer is None:
        return None
    items = sorted(tokenizer.hf.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha1("\n".join(f"{i}\t{t}" for t, i in items).encode()).hexdigest()[:16]


def fingerprint(model, tokenizer=None) -> dict:
    c = model.config
    embed = _tensor_sha(model.embed_tokens.weight)
    head = embed if model.lm_head.weight is model.embed_tokens.weight else _tensor_sha(model.lm_head.weight)
    return {
        "architecture": c.model_type,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "vocab_sha": vocab_sha(tokenizer),
        "embed_sha": embed,
        "head_sha": head,
    }


def compare(recorded: dict | None, actual: dict) -> list[str]:
    """Differences between a recorded fingerprint and the loaded target's, as readable phrases."""
    if not recorded:
        return []
    names = {"architecture": "architecture", "num_layers": "number of layers", "hidden_size": "hidden size",
             "vocab_size": "vocabulary size", "vocab_sha": "vocabulary", "embed_sha": "embedding weights",
             "head_sha": "LM head weights"}
    out = []
    for k, name in names.items():
        a, b = recorded.get(k), actual.get(k)
        if a is not None and b is not None and a != b:
            out.append(f"{name} ({a} vs {b})" if k in ("architecture", "num_layers", "hidden_size", "vocab_size")
                       else name)
    return out
