"""Whole target passes over 1..W tokens after a 128-token context, every row's logits computed (as verification
computes them), the fastest of R interleaved repeats, in decode steps: the per-row cost of verification on this
host (BENCHMARKS.md, thirteenth session).

    python scripts/width_sweep.py [MODEL] [--max-width 10] [--repeats 15]
"""

import argparse
import time

import torch

from specloom.engine import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--max-width", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    model = load(a.model, None, progress=False).model
    V, ctx = model.config.vocab_size, 128
    kv = model.new_kv(ctx + a.max_width + 1)
    g = torch.Generator().manual_seed(0)
    widths = range(1, a.max_width + 1)
    with torch.inference_mode():
        model(torch.randint(0, V, (1, ctx), generator=g), torch.arange(ctx)[None], kv, num_logits=1)
        kv.commit()
        inputs = {w: (torch.randint(0, V, (1, w), generator=g), torch.arange(ctx, ctx + w)[None]) for w in widths}
        ts = {w: [] for w in widths}
        for _ in range(a.repeats):
            for w in widths:
                s = time.perf_counter()
                model(*inputs[w], kv)
                ts[w].append(time.perf_counter() - s)
                kv.truncate(ctx)
    one = min(ts[1])
    for w in widths:
        print(f"{w:3d} tokens: {1000 * min(ts[w]):6.2f} ms  {min(ts[w]) / one:.2f} decode steps")


if __name__ == "__main__":
    main()
