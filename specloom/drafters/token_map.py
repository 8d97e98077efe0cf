"""A reduced draft vocabulary for a drafter that scores the whole vocabulary (FR-Spec's frequency-ranked drafting).

A draft model's LM head is a large share of its pass (Qwen2.5-Coder-0.5B: 151,936 x 896, ~27 % of its weights).
With `"draft_vocab": N` the draft model scores only the N most frequent tokens of a frequency ranking: its head
shrinks to N rows, its drafts are argmaxes (greedy) or samples of q renormalised over those N tokens (q is zero
elsewhere, and that is the q the verifier divides by), so the output is still the target's own; only tokens
outside the N cannot be drafted. The end-of-sequence tokens are always kept.

The ranking is a token-map file (`specloom token-map MODEL --prompts FILES --out F.json`: the target tokenizer's
token counts over a corpus, most frequent first; or `--data DIRS`: the answer tokens of self-distilled data, the
training split -- the target's own outputs, which is what a drafter must guess), named by `"token_map": path`, or else the one bundled for this
tokenizer (`specloom/bundled/token_maps/<vocabulary hash>.json`, built from the training prompts). A map made
for another tokenizer is refused.

    {"format": "specloom-token-map/1", "vocab_size": V, "vocab_sha": "...", "ranked": [ids, most frequent first],
     "counts": [their counts], "tokens_counted": n, "sources": [...], "command": "..."}
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import SpecloomError

FORMAT = "specloom-token-map/1"
BUNDLED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bundled", "token_maps")


def expand_logits(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a reduced vocabulary (its target ids `ids`) -> (..., vocab_size), -inf at every other id."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., ids] = logits
    return out


def sliced_head(head, ids: torch.Tensor) -> torch.nn.Linear:
    """The rows `ids` of an LM head (a dense linear, or a kernel's that dequantises its weight: GGML blocks give
    exactly the gguf package's values) as a plain bias-free `nn.Linear` in the head's dtype, frozen, for the
    caller to give its kernel."""
    ws = getattr(head, "ws", None)
    if ws is not None and len(ws) == 1 and hasattr(ws[0], "dense"):  # GGML: only these rows dequantised
        w = ws[0].dense(ids.cpu()).to(getattr(head, "dtype", torch.float32))
    else:
        w = head.weight.detach()[ids.to(head.weight.device)]
    out = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    return out


def drafting_rows(linear, ids: torch.Tensor) -> torch.nn.Module:
    """The rows `ids` of `linear` (`sliced_head`) with the drafting kernel the drafter's own linears run."""
    from ..models.cpu_packing import pack_linears

    holder = torch.nn.Module()
    holder.rows = sliced_head(linear, ids)
    pack_linears(holder)
    return holder.rows


def count_tokens(tokenizer, texts, vocab_size: int) -> torch.Tensor:
    """Counts (V,) of the tokenizer's ids over `texts` (no special tokens added)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    batch: list[str] = []

    def flush():
        for ids in tokenizer.hf(batch, add_special_tokens=False)["input_ids"]:
            if ids:
                counts.add_(torch.bincount(torch.tensor(ids), minlength=vocab_size)[:vocab_size])
        batch.clear()

    for t in texts:
        batch.append(t)
        if len(batch) >= 256:
            flush()
    if batch:
        flush()
    return counts


def build_token_map(tokenizer, texts, vocab_size: int, sources: list[str], command: str = "") -> dict:
    return token_map_of(count_tokens(tokenizer, texts, vocab_size), tokenizer, vocab_size, sources, command)


def token_map_of(counts: torch.Tensor, tokenizer, vocab_size: int, sources: list[str], command: str = "") -> dict:
    """The map of token counts (V,): every seen token, most frequent first (ties: the lower id)."""
    from ..fingerprint import vocab_sha

    seen = int((counts > 0).sum())
    order = counts.argsort(descending=True, stable=True)[:seen]
    return {"format": FORMAT, "vocab_size": vocab_size, "vocab_sha": vocab_sha(tokenizer),
            "ranked": order.tolist(), "counts": counts[order].tolist(), "tokens_counted": int(counts.sum()),
            "sources": sources, "command": command}


def bundled_path(tokenizer) -> str | None:
    from ..fingerprint import vocab_sha

    sha = vocab_sha(tokenizer)
    path = os.path.join(BUNDLED, f"{sha}.json") if sha else None
    return path if path and os.path.isfile(path) else None


def read_token_map(path: str, tokenizer, vocab_size: int) -> dict:
    """The checked map at `path`: ours, for this tokenizer, ids in range."""
    from ..fingerprint import vocab_sha

    if not os.path.isfile(path):
        raise SpecloomError(f"token_map {path!r}: no such file")
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecloomError(f"token_map {path!r} is not a readable JSON token map ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("ranked"), list):
        raise SpecloomError(f"token_map {path!r} is not a specloom token map (format {FORMAT!r}; make one with "
                            "`specloom token-map MODEL --prompts FILES --out F.json`)")
    if m.get("vocab_size") != vocab_size or (m.get("vocab_sha") and tokenizer is not None
                                            and m["vocab_sha"] != vocab_sha(tokenizer)):
        raise SpecloomError(f"token_map {path!r} was made for another tokenizer (vocabulary {m.get('vocab_size')}, "
                            f"hash {m.get('vocab_sha')}; this model: {vocab_size}, {vocab_sha(tokenizer)})")
    ranked = m["ranked"]
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ranked) or len(set(ranked)) != len(ranked):
        raise SpecloomError(f"token_map {path!r}: 'ranked' must list distinct token ids in [0, {vocab_size})")
    return m


def ranking(token_map: str | None, tokenizer, vocab_size: int) -> list[int]:
    """The ids of the map `token_map` (else the one bundled for this tokenizer), most frequent first."""
    path = token_map or bundled_path(tokenizer)
    if path is None:
        raise SpecloomError("draft_vocab needs a token frequency ranking for this tokenizer and none is bundled: "
                            "make one with `specloom token-map MODEL --prompts FILES --out F.json` and pass "
                            "\"token_map\": \"F.json\"")
    return read_token_map(path, tokenizer, vocab_size)["ranked"]


def reduced_vocabulary(size: int, token_map: str | None, tokenizer, vocab_size: int,
                       keep: tuple[int, ...] = ()) -> torch.Tensor:
    """The sorted ids (size,) of the `size` most frequent tokens of the map (`token_map`, else the bundled map for
    this tokenizer), `keep` (the EOS ids) always among them; ids the map never saw fill up in id order."""
    if size >= vocab_size:
        raise SpecloomError(f"draft_vocab {size} is not smaller than the vocabulary ({vocab_size} tokens): drop it")
    ranked = ranking(token_map, tokenizer, vocab_size)
    chosen = list(dict.fromkeys([k for k in keep if 0 <= k < vocab_size] + ranked))[:size]
    if len(chosen) < size:
        have = set(chosen)
        chosen += [i for i in range(vocab_size) if i not in have][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def requested_size(spec, meta: dict, path: str) -> int | None:
    """The draft vocabulary size asked for: the request's `draft_vocab`, else the checkpoint's own
    `specloom.draft_vocab`, else None; a `token_map` without a size is refused."""
    from ..config_fields import int_field

    size = spec.draft_vocab or int_field(meta, "draft_vocab", None, prefix="specloom.",
                                         what=f"{path}: drafter config", bound="vocab_size")
    if spec.token_map and not size:
        raise SpecloomError('"token_map" ranks the tokens for "draft_vocab": give "draft_vocab": N as well')
    return size


def requested_vocabulary(spec, meta: dict, tokenizer, vocab_size: int, path: str) -> torch.Tensor | None:
    """The reduced draft vocabulary a drafter that scores the target's whole vocabulary runs with (FR-Spec): the
    request's `draft_vocab` (ranked by its `token_map`, else the map bundled for the tokenizer), else the
    checkpoint's own `specloom.draft_vocab`; None where neither asks for one or the size equals the vocabulary (a
    request's way to turn a checkpoint's default off). The sorted target ids, the end-of-sequence ids among them."""
    size = requested_size(spec, meta, path)
    if not size or size == vocab_size:
        return None
    return reduced_vocabulary(size, spec.token_map, tokenizer, vocab_size,
                              tuple(getattr(tokenizer, "eos_token_ids", ()) or ()))


def ranked_rows(ids: torch.Tensor, size: int, token_map: str | None, tokenizer, vocab_size: int) -> torch.Tensor | None:
    """For a drafter whose own head already covers a reduced vocabulary (EAGLE-3's `d2t`: target ids `ids`,
    sorted): the rows (sorted positions in `ids`) of its `size` most frequent tokens by the map (`token_map`, else
    the bundled one), end-of-sequence ids first; None when `size` keeps every row."""
    if size >= ids.numel():
        return None
    ranked = ranking(token_map, tokenizer, vocab_size)
    eos = [k for k in (getattr(tokenizer, "eos_token_ids", ()) or ()) if 0 <= k < vocab_size]
    rank = torch.full((vocab_size,), vocab_size + len(ranked), dtype=torch.long)  # unseen: after every ranked id
    rank[torch.tensor(ranked, dtype=torch.long)] = torch.arange(len(ranked))
    if eos:
        rank[torch.tensor(eos)] = -1
    order = torch.argsort(rank[ids.cpu()] * (ids.numel() + 1) + torch.arange(ids.numel()))  # ties: the lower id
    return order[:size].sort().values


def use_requested_vocabulary(spec, meta: dict, model, target, tokenizer, path: str) -> None:
    """Give `model` (a drafter scoring through the target's head: EAGLE-1, MTP, the block drafters) the reduced
    vocabulary `requested_vocabulary` names, if any: those rows of the target's head with the drafter's kernel
    (`model.use_draft_vocab(ids, head)`)."""
    ids = requested_vocabulary(spec, meta, tokenizer, target.config.vocab_size, path)
    if ids is not None:
        head = drafting_rows(target.lm_head, ids)  # the rows' values as the target's, the drafter's kernel
        model.use_draft_vocab(ids.to(head.weight.device), head)

