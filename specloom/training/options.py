"""`specloom train` options as the kinds declare them (each kind's trainer module has `add_arguments(parser)`):
`option` adds a flag once -- kinds that share one (eagle3 and medusa: --draft-vocab; draft_model, dflash and
dspark: --draft-layers) each add it through the one declaration below, whose help names every kind that reads it."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def option(parser, *flags: str, **kw) -> None:
    """`parser.add_argument(*flags, **kw)` unless another kind declared the flag already."""
    if not any(f in parser._option_string_actions for f in flags):
        parser.add_argument(*flags, **kw)


# options that several kinds read: declared once here, each kind adds the ones it reads
def draft_vocabulary_options(t) -> None:
    option(t, "--draft-vocab", type=positive_int, default=None,
           help="draft vocabulary size: the most frequent answer tokens (eagle3: default 8192; medusa: default the "
                "whole vocabulary, a smaller one makes the heads' output layer cheaper)")
    option(t, "--draft-vocab-coverage", type=float, default=None,
           help="eagle3, medusa: choose the draft vocabulary as the fewest tokens covering this share of the answer "
                "tokens (at most --draft-vocab)")


def warm_start_option(t) -> None:
    option(t, "--warm-start-layer", type=int, default=None,
           help="eagle3: start the draft layer from this target layer (e.g. -1: the last); dflash, dspark: the draft "
                "layers from this and the following target layers (e.g. -3 on SmolLM2: the layer that reads the last "
                "target feature)")


def draft_layers_option(t) -> None:
    option(t, "--draft-layers", type=positive_int, default=None,
           help="draft_model: target layers kept (default 2); dflash, dspark: draft layers (default 1)")
