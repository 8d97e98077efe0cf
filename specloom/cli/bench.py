"""`specloom bench`: a candidate against baselines, interleaved in one run."""

from __future__ import annotations

import json

from ..errors import SpecloomError
from .args import positive_int, common_options


def add(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a candidate against a baseline, interleaved in one run")
    common_options(p)
    p.add_argument("--prompts", required=True, help="JSONL file; each line has turns[0] or prompt")
    p.add_argument("--limit", type=positive_int, default=None, help="use the first N prompts")
    p.add_argument("--per-category", type=positive_int, default=None, help="use the first N prompts of each category")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (e.g. summarization,rag)")
    p.add_argument("--baseline", default="plain", metavar="NAME[,NAME...]",
                   help="baseline(s) timed interleaved with the candidate, comma-separated: plain (specloom without "
                        "speculation, default), hf (HF transformers generate: fp32 on the CPU, --dtype on a GPU), hf-assisted (HF assisted "
                        "generation with --baseline-draft), hf-lookup (HF prompt lookup), llama.cpp, "
                        "llama.cpp-lookup (llama-cpp-python: pip install 'specloom[llama]'), llama.cpp-draft "
                        "(llama.cpp's draft-model speculation: scripts/build_llama_speculative.sh); the first is "
                        "the report's main baseline")
    p.add_argument("--baseline-draft", default=None, metavar="MODEL",
                   help="draft model of hf-assisted and llama.cpp-draft (default: the candidate's draft_model)")
    p.add_argument("--baseline-draft-tokens", type=positive_int, default=None, metavar="K",
                   help="tokens drafted per step by hf-assisted and llama.cpp-draft (default: each library's own: "
                        "HF 20 with its confidence stop, llama.cpp 3)")
    p.add_argument("--baseline-lookup-tokens", type=positive_int, default=10, metavar="N",
                   help="tokens copied per lookup by hf-lookup and llama.cpp-lookup (default 10; n-gram up to 2)")
    p.add_argument("--repeats", type=positive_int, default=1, metavar="N",
                   help="decode each prompt N times with every runner (rounds interleaved, the order reversed each "
                        "round) and keep each runner's fastest time: on a shared host a single timing per prompt "
                        "moves by +-20 %%; the fastest of N is the run least slowed by other work (default 1)")
    p.add_argument("--raw", action="store_true", help="use prompts as raw text (default: chat template if any)")
    p.add_argument("--compare", default=None, metavar="JSON",
                   help='several drafters vs plain in one run: \'{"name": {speculative config}, ...}\'')
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the full report here")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..bench.harness import run_bench

    if args.compare:
        from ..bench.multi import run_compare

        try:
            candidates = json.loads(args.compare)
        except json.JSONDecodeError as e:
            raise SpecloomError(f"--compare is not valid JSON: {e.msg}") from None
        run_compare(args.model, args.prompts, candidates, limit=args.limit, per_category=args.per_category,
                    categories=args.categories.split(",") if args.categories else None,
                    max_tokens=args.max_tokens, dtype=args.dtype, chat=not args.raw, json_out=args.json_out,
                    device=args.device, speculation=args.speculation, linear_kernel=args.linear_kernel,
                    kv_dtype=args.kv_dtype)
        return 0
    run_bench(
        args.model, prompts=args.prompts, limit=args.limit, per_category=args.per_category,
        categories=args.categories.split(",") if args.categories else None,
        max_tokens=args.max_tokens, dtype=args.dtype,
        speculative_config=args.speculative_config, baseline=args.baseline, chat=not args.raw, kv_dtype=args.kv_dtype,
        json_out=args.json_out, device=args.device, speculation=args.speculation, linear_kernel=args.linear_kernel,
        baseline_draft=args.baseline_draft, baseline_draft_tokens=args.baseline_draft_tokens,
        baseline_lookup_tokens=args.baseline_lookup_tokens, repeats=args.repeats,
    )
    return 0
