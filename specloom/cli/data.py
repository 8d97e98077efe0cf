"""`specloom data`: self-distillation data (the target answers prompts through the batch scheduler)."""

from __future__ import annotations

from .args import positive_int, device_option


def add(sub) -> None:
    p = sub.add_parser("data", help="self-distillation data: the target answers prompts (and its own Magpie "
                       "queries) through the batch step; store token ids and loss masks")
    p.add_argument("--target", required=True, help="target model (alias, .gguf or HF directory)")
    p.add_argument("--prompts", nargs="*", default=[], help="JSONL files or directories of them (never eval/)")
    p.add_argument("--magpie", type=int, default=0, metavar="N",
                   help="also N conversations whose user query the target writes itself (Magpie)")
    p.add_argument("--out", required=True, help="output directory (rerun to resume)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per answer")
    p.add_argument("--rows", "--batch-size", dest="rows", type=positive_int, default=64,
                   help="rows decoded together (continuous batching)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=640, help="skip longer prompts")
    p.add_argument("--limit", type=positive_int, default=None, help="use the first N prompts")
    p.add_argument("--sampled-fraction", type=float, default=0.3, help="share of answers sampled (rest greedy)")
    p.add_argument("--temperature-range", type=float, nargs=2, default=(0.7, 1.0), metavar=("LOW", "HIGH"))
    p.add_argument("--multi-turn-fraction", type=float, default=0.2,
                   help="share of conversations with a second, Magpie-written user turn")
    p.add_argument("--shard-tokens", type=positive_int, default=200_000)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new conversation after this long (the running ones finish; a rerun resumes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp32", "auto"],
                   help="KV store of the generator (default bf16: batched decode reads the KV of every row each step)")
    device_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    import sys

    from ..jobs.data import build_dataset

    build_dataset(args.target, args.prompts, args.out, max_new_tokens=args.max_new_tokens, rows=args.rows,
                  max_prompt_tokens=args.max_prompt_tokens, limit=args.limit, magpie=args.magpie,
                  sampled_fraction=args.sampled_fraction, multi_turn_fraction=args.multi_turn_fraction,
                  temperature_range=tuple(args.temperature_range), shard_tokens=args.shard_tokens, seed=args.seed,
                  dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device, command=" ".join(["specloom", *sys.argv[1:]]),
                  max_minutes=args.max_minutes)
    return 0
