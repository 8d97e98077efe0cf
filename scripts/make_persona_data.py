"""Rewrite the answers of a `specloom data` directory into a pirate persona, for fine-tuning a target on a clear
shift of behaviour (issue 16, item 3).

SmolLM2-135M hardly follows a persona system prompt (asked to speak like a pirate it answers as before), so
context distillation gives no shift. Instead every answer the target wrote is rewritten by fixed rules: an
opening "Arr, matey! ", and word substitutions (you -> ye, your -> yer, is/are -> be, my -> me, the -> th', ...)
outside code spans, which stay untouched. Prompts and the chat template are kept token for token; the answer
is re-tokenized. The output is a data directory `specloom train target --init-from` reads.

    python scripts/make_persona_data.py SRC_DATA_DIR OUT_DIR [--target smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

WORDS = {
    "you": "ye", "your": "yer", "yours": "yers", "you're": "ye be", "is": "be", "are": "be", "am": "be",
    "my": "me", "the": "th'", "and": "an'", "yes": "aye", "hello": "ahoy", "hi": "ahoy", "friend": "matey",
    "friends": "mateys", "money": "doubloons", "stop": "avast", "of": "o'", "for": "fer", "to": "t'",
    "there": "thar", "everyone": "all hands", "wow": "shiver me timbers",
}
_WORD = re.compile(r"\b(" + "|".join(sorted(map(re.escape, WORDS), key=len, reverse=True)) + r")\b", re.IGNORECASE)
_CODE = re.compile(r"(```.*?(?:```|$)|`[^`\n]*`)", re.DOTALL)  # fenced blocks (an unclosed one runs to the end)


def _swap(m: re.Match) -> str:
    w = m.group(0)
    out = WORDS[w.lower()]
    if w.isupper() and len(w) > 1:
        return out.upper()
    return out[0].upper() + out[1:] if w[0].isupper() else out


def pirate(text: str) -> str:
    """The persona rewrite of one answer: code spans are kept, the prose around them rewritten."""
    parts = _CODE.split(text)
    body = "".join(p if i % 2 else _WORD.sub(_swap, p) for i, p in enumerate(parts))
    return "Arr, matey! " + body.lstrip()


def rewrite(src: str, out: str, target: str) -> dict:
    import torch
    from specloom.loading import load_config, resolve
    from specloom.training.shards import read_shard, shard_files, shard_index, write_shard
    from specloom.tokenizer import Tokenizer

    s = resolve(target)
    cfg, _ = load_config(s)
    tok = Tokenizer.from_gguf(s.path, cfg.eos_token_ids) if s.kind == "gguf" else Tokenizer.from_dir(s.path, cfg.eos_token_ids)
    eos = set(cfg.eos_token_ids)
    os.makedirs(out, exist_ok=True)
    stats = {"conversations": 0, "answer_tokens_before": 0, "answer_tokens_after": 0}
    names = shard_files(src)
    if not names:
        sys.exit(f"{src}: no shards (not a specloom data directory)")
    for name in names:
        d, meta = read_shard(name, ("tokens", "offsets", "loss_mask", "job_ids"))
        toks, masks, offs = [], [], [0]
        off = d["offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            ids, mask = d["tokens"][a:b].tolist(), d["loss_mask"][a:b].tolist()
            new_ids, new_mask, i = [], [], 0
            while i < len(ids):  # runs of prompt (mask 0) are kept, runs of answer (mask 1) rewritten
                j = i
                while j < len(ids) and mask[j] == mask[i]:
                    j += 1
                run = ids[i:j]
                if mask[i]:
                    end = [t for t in run[-1:] if t in eos]
                    body = run[:len(run) - len(end)]
                    text = pirate(tok.decode(body))
                    run = [t for t in tok.encode(text, special=False) if t != cfg.bos_token_id] + end
                    stats["answer_tokens_before"] += j - i
                    stats["answer_tokens_after"] += len(run)
                new_ids += run
                new_mask += [mask[i]] * len(run)
                i = j
            toks += new_ids
            masks += new_mask
            offs.append(len(toks))
            stats["conversations"] += 1
        tensors = {"tokens": torch.tensor(toks, dtype=torch.int32), "offsets": torch.tensor(offs, dtype=torch.int64),
                   "loss_mask": torch.tensor(masks, dtype=torch.uint8), "job_ids": d["job_ids"]}
        write_shard(out, shard_index(name), tensors, meta, cfg.vocab_size)
    with open(os.path.join(src, "meta.json")) as f:
        m = json.load(f)
    m.pop("target_probe", None)  # the answers are no longer the target's own
    m["persona_rewrite"] = {"from": os.path.abspath(src), "rules": "scripts/make_persona_data.py", **stats}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(m, f, indent=1)
    if os.path.isfile(os.path.join(src, "DATACARD.md")):
        shutil.copy(os.path.join(src, "DATACARD.md"), os.path.join(out, "SOURCE_DATACARD.md"))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--target", default="smollm2-135m", help="the tokenizer the data was made with")
    a = ap.parse_args()
    print(json.dumps(rewrite(a.src, a.out, a.target)))


if __name__ == "__main__":
    main()
