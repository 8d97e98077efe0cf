"""Held-out top-1 agreement of EAGLE-3 checkpoints on datasets/smollm2-135m's held-out split (the one `specloom
train` uses: seed 0, 2 %), by the trainer's own `evaluate`: the 4 batches its periodic evaluation reads and the
first 16 -- so checkpoints from different runs compare on the same batches (BENCHMARKS.md, issue 39 ninth session).

    python scripts/eagle_heldout.py CKPT [CKPT ...]
"""
import argparse, sys, torch
from specloom.cli import train as ct
from specloom.jobs import train as J
from specloom.loading import load_target
from specloom.training.dataset import DistillData
ap = argparse.ArgumentParser(); sub = ap.add_subparsers(); ct.add(sub)
for ck in sys.argv[1:]:
    args = ap.parse_args(["train", "eagle3", "--target", "smollm2-135m", "--data", "datasets/smollm2-135m", "--out",
                          "/tmp/none", "--init-from", ck, "--ttt-steps", "4", "--loss-fraction", "0.5", "--cache-hidden-gb", "0"])
    torch.manual_seed(0)
    tcls = J.load_trainers()["eagle3"]
    target, tok = load_target("smollm2-135m", "bf16", pack=False)
    L = target.config.num_layers
    data = DistillData(args.data, tuple(sorted({*tcls.data_ids(L), L})))
    data.attach(load_target("smollm2-135m", "bf16", progress=False)[0], 0)
    _, ev_idx = data.split(args.eval_fraction)
    for k, v in tcls.arg_defaults.items():
        if getattr(args, k, None) is None: setattr(args, k, v)
    tr = tcls(target, tok, data, args); tr.init_from(ck)
    tr.used = torch.arange(tr.model.d2t.numel()) + tr.model.d2t
    tr.model.eval()
    with torch.no_grad():
        four = J.evaluate(tr, data, ev_idx, args, max_batches=4)
        whole = J.evaluate(tr, data, ev_idx, args, max_batches=16)
    print(ck, "4 batches:", {k: round(v, 4) for k, v in four.items()}, flush=True)
    print(ck, "16 batches:", {k: round(v, 4) for k, v in whole.items()}, len(ev_idx), "sequences", flush=True)
