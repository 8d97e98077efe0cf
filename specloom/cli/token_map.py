"""`specloom token-map`: a tokenizer's tokens ranked by frequency over prompts."""

from __future__ import annotations

import sys


def add(sub) -> None:
    p = sub.add_parser("token-map", help="rank a tokenizer's tokens by frequency over prompts: the ranking a "
                        "draft model's reduced vocabulary (\"draft_vocab\": N) takes its N tokens from")
    p.add_argument("model", help="the target (alias, .gguf or HF directory): its tokenizer")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", nargs="+", help="JSONL files or directories of them (`turns` or "
                     "`prompt`, as `specloom data` reads); use training prompts, not the benchmark's")
    src.add_argument("--data", nargs="+", help="self-distilled data directories (`specloom data`) of this target: "
                     "the answer tokens of their training split (the held-out split `specloom train` evaluates on "
                     "is left out)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..atomic import write_json
    from ..drafters.token_map import build_token_map, token_map_of
    from ..loading import load_config, load_tokenizer, resolve
    from ..prompts import read_prompts

    tok = load_tokenizer(args.model)
    vocab_size = load_config(resolve(args.model))[0].vocab_size  # the model's (its embedding may be padded)
    command = " ".join(["specloom", *sys.argv[1:]])
    if args.data:
        counts, what = _answer_counts(args.data, vocab_size, tok)
        m = token_map_of(counts, tok, vocab_size, sorted(set(args.data)), command)
    else:
        texts = [r["text"] for r in read_prompts(args.prompts, refuse_eval=True)]
        m = build_token_map(tok, texts, vocab_size, sorted(set(args.prompts)), command)
        what = f"{len(texts)} prompts"
    write_json(args.out, m)
    sizes = (4096, 8192, 16384, 32768)
    share = [sum(m["counts"][:n]) / max(1, m["tokens_counted"]) for n in sizes]
    print(f"{args.out}: {len(m['ranked'])} distinct tokens of {m['tokens_counted']} counted over {what}; the top "
          + " / ".join(map(str, sizes)) + " cover " + " / ".join(f"{s:.1%}" for s in share))
    return 0


def _answer_counts(dirs, vocab_size: int, tokenizer=None):
    """Counts (V,) of the answer (loss-masked) tokens of the data's training split, and what was counted."""
    from ..errors import SpecloomError
    from ..training.common import answer_counts
    from ..training.dataset import DistillData

    data = DistillData(dirs, ())
    if tokenizer is not None:
        from ..fingerprint import vocab_sha

        theirs, ours = (data.meta.get("fingerprint") or {}).get("vocab_sha"), vocab_sha(tokenizer)
        if theirs and ours and theirs != ours:
            raise SpecloomError(f"{' '.join(dirs)} was made with another tokenizer (vocabulary hash {theirs}; this "
                                f"model's {ours})")
    train, _ = data.split(0.02)  # `specloom train`'s default held-out fraction
    top = max((int(t.max()) for t, _, _ in data.seqs if t.numel()), default=0)
    if top >= vocab_size:
        raise SpecloomError(f"{' '.join(dirs)}: token id {top} is outside this model's vocabulary ({vocab_size}): "
                            "the data was made with another model")
    return answer_counts(data, vocab_size, train), f"the answers of {len(train)} training sequences"
