"""`specloom` command line: one module per command (`generate`, `bench`, `data`, `train`, `serve`, `bench-serve`,
`bench-soak`, `doctor`, `plot`, `token-map`, `report`; `quantize` and `export` register from their packages). Each
command module has `add(sub)`, which adds its parser and sets `run`, and `run(args)`.

Every `SpecloomError` (bad input, impossible setting) is printed as one line `specloom: error: ...` and exits
with status 2; there is no traceback for a user's mistake. May import anything; nothing imports it (but
`__main__`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import SpecloomError
from . import (bench, bench_serve, bench_soak, data, doctor, generate, plot, report, serve, token_map,
               train)
from .generate import invariance_gap, passes_invariant  # noqa: F401  (the engine's invariance, reported by generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specloom", description="Exact speculative decoding in PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, bench, data, train, serve, bench_serve, bench_soak, doctor):
        command.add(sub)
    from ..export import add_parser as add_export, run as run_export
    from ..quantize.cli import add_parser as add_quantize, run as run_quantize

    add_quantize(sub)
    add_export(sub)
    sub.choices["quantize"].set_defaults(run=run_quantize)
    sub.choices["export"].set_defaults(run=run_export)
    for command in (plot, token_map, report):
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        import warnings

        warnings.filterwarnings("ignore")
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    try:
        if hasattr(args, "device"):  # before anything loads: a bad device is one line, no traceback
            from ..loading import parse_device

            args.device = str(parse_device(args.device))
        if args.command in ("generate", "bench", "serve", "bench-serve", "doctor"):  # so is a bad --kv-cache-dtype
            from ..kv_quant import kv_dtype_arg

            kv_dtype_arg(args.kv_dtype)
        return args.run(args)
    except SpecloomError as e:
        print(f"specloom: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
