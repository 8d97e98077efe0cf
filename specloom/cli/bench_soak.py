"""`specloom bench-soak`: soak and fault test of a real server."""

from __future__ import annotations

import sys

from ..errors import SpecloomError
from .args import positive_int, device_option


def add(sub) -> None:
    p = sub.add_parser("bench-soak", help="soak and fault test: a real `specloom serve` for N minutes under "
                                           "greedy load, client disconnects, malformed and poisoned requests")
    p.add_argument("model")
    p.add_argument("--prompts", required=True, help="JSONL prompts (Spec-Bench style)")
    p.add_argument("--speculative-config", default='{"method": "ngram"}', help="JSON, as for serve ('' for none)")
    p.add_argument("--speculation", default="fixed", choices=["load_aware", "fixed", "off"],
                    help="the server's depth policy (default fixed: acceptance independent of load)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=positive_int, default=16)
    p.add_argument("--num-prompts", type=positive_int, default=32, help="distinct prompts (each sent alone first)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"],
                    help="fp32 (default): a batched greedy answer equals its alone answer exactly")
    p.add_argument("--max-model-len", type=positive_int, default=1024)
    p.add_argument("--disconnect-fraction", type=float, default=0.12)
    p.add_argument("--malformed-fraction", type=float, default=0.05)
    p.add_argument("--poisoned-fraction", type=float, default=0.03)
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                    help="the first part of the soak that RSS flatness does not cover")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--server-log", default=None, help="the server's output (default: a temporary file)")
    device_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..bench.soak import run_soak

    if not 0 < args.minutes < float("inf"):
        raise SpecloomError(f"--minutes must be a positive number, got {args.minutes}")
    s = run_soak(args.model, args.prompts, args.speculative_config or None, args.minutes, args.concurrency,
                 args.num_prompts, args.max_tokens, args.dtype, args.max_model_len, args.speculation,
                 args.disconnect_fraction, args.malformed_fraction, args.poisoned_fraction, args.warmup_fraction,
                 args.seed, args.json, args.server_log, args.device,
                 command=" ".join(["specloom", *sys.argv[1:]]))
    return 0 if s["passed"] else 1
