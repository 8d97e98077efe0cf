"""Spot check of the real draft/target pair: Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct.

Each prompt is decoded greedily by plain decoding and with `draft_model` (fixed depth), both with the one loaded
target, alternately; the outputs must be identical. Prints per prompt the acceptance, tau and tokens/s of both.

    python scripts/check_qwen_pair.py [--dtype fp32] [--max-tokens 32] [--k 3] [--json OUT]

Needs the parts installed (see the README's "A real draft/target pair" section).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPTS = [  # (text, chat)
    ("def quicksort(xs):\n    \"\"\"Sort a list of numbers with quicksort.\"\"\"\n", False),
    ("Write a Python function that checks whether a string is a palindrome.", True),
    ("import json\n\n\ndef load_config(path):\n", False),
    ("Explain in two sentences what a hash map is.", True),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--json", help="write the per-prompt figures here")
    args = ap.parse_args(argv)

    from specloom.engine import Engine
    from specloom.loading import load_target
    from specloom.speculative import SpeculativeConfig

    t0 = time.perf_counter()
    target, tok = load_target(args.target, args.dtype)
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k})
    plain = Engine(target, tok)
    spec_engine = Engine(target, tok, spec, speculation="fixed")
    print(f"loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    warm = tok.encode("x = 1")
    plain.generate(prompt_token_ids=warm, max_tokens=2)
    spec_engine.generate(prompt_token_ids=warm, max_tokens=2)

    rows, same = [], 0
    for text, chat in PROMPTS[:args.prompts]:
        ids = tok.encode_chat([{"role": "user", "content": text}]) if chat else tok.encode(text)
        a = plain.generate(prompt_token_ids=ids, max_tokens=args.max_tokens)
        b = spec_engine.generate(prompt_token_ids=ids, max_tokens=args.max_tokens)
        ok = a.token_ids == b.token_ids
        same += ok
        acc = b.num_accepted_tokens / b.num_draft_tokens if b.num_draft_tokens else 0.0
        row = {"prompt": text[:40], "chat": chat, "identical": ok, "tokens": len(b.token_ids),
               "plain_tok_s": round(a.tokens_per_second, 2), "spec_tok_s": round(b.tokens_per_second, 2),
               "tau": round(b.mean_accepted_length, 3), "accepted": b.num_accepted_tokens,
               "drafted": b.num_draft_tokens, "acceptance": round(acc, 3),
               "acceptance_per_position": [round(x, 3) for x in b.acceptance_per_position]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not ok:
            print(f"  plain: {tok.decode(a.token_ids)!r}\n  spec:  {tok.decode(b.token_ids)!r}", flush=True)
    acc = sum(r["accepted"] for r in rows) / max(1, sum(r["drafted"] for r in rows))
    plain_s = sum(r["tokens"] / r["plain_tok_s"] for r in rows if r["plain_tok_s"])
    spec_s = sum(r["tokens"] / r["spec_tok_s"] for r in rows if r["spec_tok_s"])
    tokens = sum(r["tokens"] for r in rows)
    print(f"identical {same}/{len(rows)}; acceptance {acc:.3f}; plain {tokens / plain_s:.2f} tok/s, "
          f"draft_model k={args.k} {tokens / spec_s:.2f} tok/s ({plain_s / spec_s:.2f}x)")
    if args.json:
        from specloom.atomic import write_json

        write_json(args.json, {"args": vars(args), "rows": rows, "acceptance": acc}, indent=1)
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
