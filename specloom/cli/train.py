"""`specloom train`: train a drafter on `specloom data` output; each kind adds its own options."""

from __future__ import annotations

from .args import positive_int, device_option


def add(sub) -> None:
    p = sub.add_parser("train", help="train a drafter on `specloom data` output")
    p.add_argument("kind", help="medusa | eagle | eagle3 | draft_model | mtp | dflash | dspark | target (a new small "
                   "model trained from scratch jointly with --mtp N MTP layers; --target names its tokenizer)")
    p.add_argument("--target", required=True, help="the target model the data was made with")
    p.add_argument("--data", required=True, nargs="+", help="directories written by `specloom data`")
    p.add_argument("--out", required=True, help="output checkpoint directory (rerun to resume)")
    p.add_argument("--init-from", default=None, help="start from this drafter checkpoint")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens-per-batch", type=positive_int, default=4096)
    p.add_argument("--ttt-steps", type=positive_int, default=3, help="training-time-test unroll (eagle, eagle3)")
    p.add_argument("--draft-vocab", type=positive_int, default=None,
                   help="draft vocabulary size: the most frequent answer tokens (eagle3: default 8192; medusa: "
                        "default the whole vocabulary, a smaller one makes the heads' output layer cheaper)")
    p.add_argument("--draft-vocab-coverage", type=float, default=None,
                   help="eagle3, medusa: choose the draft vocabulary as the fewest tokens covering this share of "
                        "the answer tokens (at most --draft-vocab)")
    p.add_argument("--loss-fraction", type=float, default=0.5,
                   help="fraction of positions scored per batch by large-vocabulary losses (speed knob)")
    p.add_argument("--token-weight", type=float, default=0.5, help="eagle: weight of the token loss")
    p.add_argument("--medusa-heads", type=positive_int, default=4)
    p.add_argument("--draft-layers", type=positive_int, default=None,
                   help="draft_model: target layers kept (default 2); dflash, dspark: draft layers (default 1)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="dflash, dspark: tokens per block (default: dflash 6 = 5 drafts, dspark 5 = 5 drafts)")
    p.add_argument("--num-anchors", type=positive_int, default=32,
                   help="dflash, dspark: blocks (anchors) trained per sequence and batch")
    p.add_argument("--markov-rank", type=int, default=32, help="dspark: Markov head rank (0 = none)")
    p.add_argument("--markov-head", choices=("vanilla", "gated", "rnn"), default="vanilla",
                   help="dspark: Markov head type")
    p.add_argument("--draft-intermediate", type=positive_int, default=None,
                   help="dflash, dspark: MLP width of the draft layers (default: half the target's)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="dflash, dspark: the MASK token of the block (default: the highest-id special token that "
                        "is not BOS/EOS/pad and never occurs in the data, e.g. SmolLM2's <empty_output>)")
    import importlib

    from ..drafters import KINDS

    for module in dict.fromkeys(m for kind in KINDS.values() for m in kind.trainers):  # kinds' own options
        add = getattr(importlib.import_module(module), "add_arguments", None)
        if add is not None:
            add(p)
    p.add_argument("--max-data-tokens", type=positive_int, default=None, help="read only this many tokens")
    p.add_argument("--cache-hidden-gb", type=float, default=None,
                   help="tokens-only data: keep up to this many GB of recomputed hidden states in memory for later "
                        "epochs (default: half the memory available at start; 0: recompute every batch)")
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this long (then evaluate and save as at the end)")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="held-out evaluation every N steps (the learning curve in evals.json and the manifest)")
    p.add_argument("--save-every", type=positive_int, default=100)
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32 (default: bf16 autocast)")
    device_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..jobs.train import run_training

    args.command = "specloom train " + args.kind
    run_training(args)
    print(args.out)
    return 0
