"""`specloom token-map`: a tokenizer's tokens ranked by frequency over prompts."""

from __future__ import annotations

import sys


def add(sub) -> None:
    p = sub.add_parser("token-map", help="rank a tokenizer's tokens by frequency over prompts: the ranking a "
                        "draft model's reduced vocabulary (\"draft_vocab\": N) takes its N tokens from")
    p.add_argument("model", help="the target (alias, .gguf or HF directory): its tokenizer")
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL files or directories of them (`turns` or "
                    "`prompt`, as `specloom data` reads); use training prompts, not the benchmark's")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..atomic import write_json
    from ..drafters.token_map import build_token_map
    from ..loading import load_config, load_tokenizer, resolve
    from ..prompts import read_prompts

    texts = [r["text"] for r in read_prompts(args.prompts, refuse_eval=True)]
    tok = load_tokenizer(args.model)
    vocab_size = load_config(resolve(args.model))[0].vocab_size  # the model's (its embedding may be padded)
    m = build_token_map(tok, texts, vocab_size, sorted(set(args.prompts)),
                        " ".join(["specloom", *sys.argv[1:]]))
    write_json(args.out, m)
    share = [sum(m["counts"][:n]) / max(1, m["tokens_counted"]) for n in (16384, 32768, 65536)]
    print(f"{args.out}: {len(m['ranked'])} distinct tokens of {m['tokens_counted']} counted over {len(texts)} "
          f"prompts; the top 16384 / 32768 / 65536 cover " + " / ".join(f"{s:.1%}" for s in share))
    return 0
