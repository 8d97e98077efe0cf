"""Self-distillation data: the target answers training prompts; we store what the drafters learn from.

`specloom data --target smollm2-135m --prompts ../shared/data/train --out data/smollm2`

* Prompts: JSONL files (a `turns` list, first turn = the user message, or a `prompt` field), or a directory of
  them. Prompts longer than `--max-prompt-tokens` after the chat template are skipped (counted in the log).
* Generation: batched greedy decoding with our own engine model (left padding, one KV cache per batch, a row stops
  at an end-of-turn token; rows that stopped are not stored past their end).
* Stored per batch in `shard_NNNNN.safetensors`: `tokens` (int32, all sequences concatenated), `offsets` (int64,
  sequence starts, one extra at the end), `loss_mask` (uint8, 1 on the target's own answer tokens),
  `hidden.{id}` (bf16, [tokens, H]) for the requested HF `hidden_states` ids (default: EAGLE-3's low/mid/high ids
  and the final post-norm state, which also gives the target's logits through its head).
* Resumable: shards are written atomically and a rerun skips the ones present (prompt order is deterministic);
  `meta.json` records the target fingerprint, ids and settings, and a rerun with other settings is refused.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch

from ..errors import SpecloomError


def eagle3_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature ids (HF hidden_states index): low, middle, high."""
    return (2, num_layers // 2, num_layers - 3)


def default_capture(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({*eagle3_layer_ids(num_layers), num_layers}))


def read_prompts(paths: list[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "*.jsonl")))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise SpecloomError(f"{p}: no such file or directory")
    if not files:
        raise SpecloomError(f"no .jsonl prompt files found in {paths}")
    prompts = []
    for fn in files:
        with open(fn) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise SpecloomError(f"{fn}:{n}: not valid JSON") from None
                text = (row.get("turns") or [None])[0] if isinstance(row, dict) else None
                text = text or (row.get("prompt") if isinstance(row, dict) else None)
                if not isinstance(text, str):
                    raise SpecloomError(f"{fn}:{n}: expected a 'turns' list or a 'prompt' string")
                prompts.append(text)
    return prompts


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new: int, eos: frozenset[int], capture: tuple[int, ...]):
    """Greedy batched generation with left padding. Returns per row (token ids prompt+answer, answer length,
    {id: hidden (n, H)})."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    pad = [P - len(p) for p in prompts]
    dev = model.device
    kv = model.new_kv(P + max_new, batch=B)  # the default KV dtype (fp32 on CPU)
    pad_t = torch.tensor(pad, device=dev)
    slots = torch.arange(P + max_new, device=dev)
    valid = slots[None, :] >= pad_t[:, None]  # (B, S): real (not padding) slots
    # Prefill row by row (the causal fast path, no padding), copied into the batch cache right-aligned.
    hidden: dict[int, list] = {c: [] for c in capture}
    last_logits = []
    one = model.new_kv(P, dtype=kv.dtype)
    for r, p in enumerate(prompts):
        one.reset()
        n = len(p)
        out = model(torch.tensor([p], device=dev), torch.arange(n, device=dev)[None], one, capture=capture,
                    num_logits=1)
        kv.k[:, r, :, pad[r]:P] = one.k[:, 0, :, :n]
        kv.v[:, r, :, pad[r]:P] = one.v[:, 0, :, :n]
        kv.slot_pos[r, pad[r]:P] = torch.arange(n, device=dev)
        for c in capture:
            hidden[c].append(torch.nn.functional.pad(out.hidden[c][0], (0, 0, pad[r], 0)))
        last_logits.append(out.logits[0, -1])
    kv.lengths = [P] * kv.rows
    hidden = {c: [torch.stack(v)] for c, v in hidden.items()}
    positions = torch.tensor([[len(p) - 1] for p in prompts], device=dev)
    next_tok = torch.stack(last_logits).argmax(-1)
    gen = [next_tok]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    lengths = torch.full((B,), max_new, dtype=torch.long)
    eos_t = torch.tensor(sorted(eos), device=dev) if eos else torch.empty(0, dtype=torch.long, device=dev)
    pos = positions[:, -1] + 1
    for step in range(1, max_new + 1):
        is_eos = torch.isin(next_tok, eos_t) & ~done
        for r in is_eos.nonzero().flatten().tolist():
            lengths[r] = step
        done |= is_eos
        if step == max_new or bool(done.all()):
            break
        S = kv.length + 1
        m = valid[:, None, :S]
        out = model(next_tok[:, None], pos[:, None], kv, attn_mask=m, capture=capture)
        kv.commit()
        for c in capture:
            hidden[c].append(out.hidden[c])
        next_tok = out.logits[:, -1].argmax(-1)
        gen.append(next_tok)
        pos = pos + 1
    gen_t = torch.stack(gen, 1)  # (B, steps)
    hid = {c: torch.cat(v, 1) for c, v in hidden.items()}  # (B, P + steps - 1, H): the last token never ran
    rows = []
    for r in range(B):
        n = int(min(lengths[r], gen_t.shape[1]))
        ids = prompts[r] + gen_t[r, :n].tolist()
        # hidden of the last answer token is not needed (nothing follows it); store len(ids) - 1 rows + pad one
        h = {c: v[r, pad[r]:pad[r] + len(ids) - 1] for c, v in hid.items()}
        h = {c: torch.cat([x, x[-1:]], 0) for c, x in h.items()}
        rows.append((ids, n, h))
    return rows


def build_dataset(
    target: str,
    prompt_paths: list[str],
    out_dir: str,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    max_prompt_tokens: int = 640,
    max_batch_tokens: int = 40960,
    limit: int | None = None,
    capture: tuple[int, ...] | None = None,
    dtype: str = "bf16",
    device: str | None = "cpu",
) -> dict:
    from ..loading import load_target
    from ..fingerprint import fingerprint

    prompts = read_prompts(prompt_paths)
    model, tok = load_target(target, dtype, device=device)
    L = model.config.num_layers
    capture = tuple(capture) if capture else default_capture(L)
    encoded, skipped = [], 0
    for text in prompts:
        ids = tok.encode_chat([{"role": "user", "content": text}]) if tok.has_chat_template else tok.encode(text)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        encoded.append(ids)
    if limit:
        encoded = encoded[:limit]
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))  # similar lengths share a batch
    batches: list[list[int]] = [[]]
    for i in order:  # at most batch_size rows and ~max_batch_tokens KV slots per batch
        if batches[-1] and (len(batches[-1]) >= batch_size
                            or (len(batches[-1]) + 1) * (len(encoded[i]) + max_new_tokens) > max_batch_tokens):
            batches.append([])
        batches[-1].append(i)
    batches = [b for b in batches if b]
    H = model.config.hidden_size
    avg_prompt = sum(len(e) for e in encoded) / max(len(encoded), 1)
    est_tokens = len(encoded) * (avg_prompt + max_new_tokens)
    est_bytes = est_tokens * (len(capture) * H * 2 + 5)
    meta = {
        "target": target, "fingerprint": fingerprint(model, tok), "capture": list(capture), "hidden_size": H,
        "max_new_tokens": max_new_tokens, "batch_size": batch_size, "max_batch_tokens": max_batch_tokens, "max_prompt_tokens": max_prompt_tokens,
        "num_prompts": len(encoded), "prompt_files": prompt_paths, "dtype": dtype,
    }
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        keys = ("capture", "max_new_tokens", "batch_size", "max_prompt_tokens", "num_prompts",
                "max_batch_tokens")
        diff = [k for k in keys if old.get(k) != meta[k]]
        if diff or old.get("fingerprint", {}).get("vocab_sha") != meta["fingerprint"]["vocab_sha"]:
            raise SpecloomError(f"{out_dir} holds data made with other settings ({diff or 'another target'}); "
                                "use a new --out directory")
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    print(f"specloom data: {len(encoded)} prompts ({skipped} longer than {max_prompt_tokens} tokens skipped), "
          f"{len(batches)} batches (<= {batch_size} rows); at most ~{est_tokens / 1e6:.2f}M tokens, "
          f"~{est_bytes / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    done_tokens = 0
    for b, idx in enumerate(batches):
        path = os.path.join(out_dir, f"shard_{b:05d}.safetensors")
        if os.path.isfile(path):
            continue
        rows = generate_batch(model, [encoded[i] for i in idx], max_new_tokens, tok.eos_token_ids, capture)
        toks, masks, offs = [], [], [0]
        hid = {c: [] for c in capture}
        for (ids, n, h), i in zip(rows, idx):
            toks += ids
            masks += [0] * (len(ids) - n) + [1] * n
            offs.append(len(toks))
            for c in capture:
                hid[c].append(h[c])
        tensors = {
            "tokens": torch.tensor(toks, dtype=torch.int32),
            "offsets": torch.tensor(offs, dtype=torch.int64),
            "loss_mask": torch.tensor(masks, dtype=torch.uint8),
        }
        for c in capture:
            tensors[f"hidden.{c}"] = torch.cat(hid[c]).to("cpu", torch.bfloat16).contiguous()
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
        done_tokens += len(toks)
        el = time.perf_counter() - t0
        print(f"specloom data: batch {b + 1}/{len(batches)}  {done_tokens} tokens this run  "
              f"{done_tokens / el:.0f} tok/s  {el:.0f}s", file=sys.stderr, flush=True)
    return meta
