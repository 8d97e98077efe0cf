"""The `specloom quantize` subcommand: its options and what it runs (registered by specloom/cli.py)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    q = sub.add_parser("quantize", help="write a quantized HF checkpoint (FP8 / MXFP4 / NVFP4, round to nearest) of "
                       "a model or a drafter directory, optionally with the target's built-in drafters")
    q.add_argument("model", help="alias (smollm2-135m), a .gguf file, a HF model directory or a drafter directory")
    # checked in quantize() (rtn.writer_for), so that a bad name is one SpecloomError line
    q.add_argument("--format", required=True, metavar="{fp8,mxfp4,nvfp4}",
                   help="fp8: E4M3 with 128x128 block scales (DeepSeek's weight_scale_inv); mxfp4: OCP MX "
                        "(weight_blocks / weight_scales); nvfp4: ModelOpt (weight_scale E4M3 per 16, weight_scale_2)")
    q.add_argument("--out", required=True, help="output directory (new or empty)")
    q.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="modules left dense (glob, or re:REGEX), written into the config's exclude list")
    q.add_argument("--with-drafters", default=None, metavar="dspark,mtp",
                   help="also write the target's built-in drafter layers (its own, or the overlay bundled for it)")
    q.add_argument("--drafter-format", default=None, metavar="{fp8,mxfp4,nvfp4,bf16}",
                   help="the built-in drafters' format (default: --format; another one makes the config ModelOpt "
                        "MIXED_PRECISION, each module declared)")
    q.add_argument("--dense-dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="embeddings, norms, heads and excluded modules (default bf16)")
    return q


def run(args) -> int:
    from .checkpoint import quantize

    quantize(args.model, args.format, args.out, args.exclude, args.with_drafters, args.drafter_format,
             args.dense_dtype)
    print(args.out)
    return 0
