"""`specloom bench-serve`: throughput and latency vs concurrency through the server."""

from __future__ import annotations

from .args import positive_int, device_option, kv_cache_dtype_option


def add(sub) -> None:
    p = sub.add_parser("bench-serve", help="throughput and latency vs concurrency through the server: speculation "
                                            "off / fixed / load-aware, side by side in one run")
    p.add_argument("model")
    p.add_argument("--speculative-config", default=None)
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--modes", nargs="+", default=["off", "fixed", "load_aware"],
                    choices=["off", "fixed", "load_aware"])
    p.add_argument("--prompts", required=True, help="JSONL prompts (Spec-Bench style)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--requests-per-level", type=positive_int, default=8, help="at least; 2 x concurrency if more")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--max-model-len", type=positive_int, default=1024)
    kv_cache_dtype_option(p)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="PNG: throughput, latency and speed-up vs concurrency")
    device_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..bench.serve_load import run_serve_bench

    run_serve_bench(args.model, args.speculative_config, args.concurrency, args.modes, args.prompts,
                    args.max_tokens, args.dtype, args.requests_per_level, args.max_model_len, args.json, args.plot,
                    device=args.device, kv_dtype=args.kv_dtype)
    return 0
