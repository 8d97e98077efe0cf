"""`specloom train`: train a drafter on `specloom data` output; each kind adds its own options."""

from __future__ import annotations

from .args import positive_int, device_option


def add(sub) -> None:
    p = sub.add_parser("train", help="train a drafter on `specloom data` output")
    p.add_argument("--target", required=True, help="the target model the data was made with")
    p.add_argument("--data", required=True, nargs="+", help="directories written by `specloom data`")
    p.add_argument("--out", required=True, help="output checkpoint directory (rerun to resume)")
    p.add_argument("--init-from", default=None, help="start from this drafter checkpoint")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0,
                   help="batch order and sampling (the held-out split is fixed by the data, not by this)")
    p.add_argument("--tokens-per-batch", type=positive_int, default=4096)
    p.add_argument("--loss-fraction", type=float, default=0.5,
                   help="fraction of positions scored per batch by large-vocabulary losses (speed knob)")
    import importlib

    from ..drafters import KINDS
    from ..jobs.train import load_trainers

    trainers = load_trainers()  # each kind's record names its trainer modules; they add the kind's own options
    p.add_argument("kind", help=" | ".join(trainers) + " (target: a new small model trained from scratch jointly "
                   "with --mtp N MTP layers; --target names its tokenizer)")
    for module in dict.fromkeys(m for kind in KINDS.values() for m in kind.trainers):
        add = getattr(importlib.import_module(module), "add_arguments", None)
        if add is not None:
            add(p)
    p.add_argument("--max-data-tokens", type=positive_int, default=None, help="read only this many tokens")
    p.add_argument("--cache-hidden-gb", type=float, default=None,
                   help="tokens-only data: keep up to this many GB of recomputed hidden states in memory for later "
                        "epochs (default: half the memory available at start -- in a run of one pass over the "
                        "data, or one --max-minutes ends, only the held-out sequences' states; 0: recompute every "
                        "batch)")
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this long in all (a resumed run goes on with what is left), then "
                        "evaluate and save as at the end")
    p.add_argument("--anneal-by-time", action="store_true",
                   help="with --max-minutes: the learning rate decays over the time budget where that ends before "
                        "the steps do (a time-limited run, e.g. on a lent GPU, ends annealed)")
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
