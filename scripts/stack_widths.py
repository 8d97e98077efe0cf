"""Layer-only pass times (no LM head) of a GGUF target with the fused decoder stack on and off, one process, after
128 cached tokens: the 5th fastest of 20 passes of each width (BENCHMARKS.md, issue 37).

    python scripts/stack_widths.py smollm2-135m --widths 1,2,4,9,16,32
"""

import argparse
import os
import time

import torch

from specloom.loading import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--widths", default="1,2,4,9,16,32")
    a = ap.parse_args()
    m, _ = load_target(a.model, "bf16", progress=False, kernel="ggml")
    kv, ctx = m.new_kv(400), 128
    with torch.inference_mode():
        m(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], kv, num_logits=1)
        kv.commit()
        for flag, name in (("1", "fused stack"), ("0", "layer by layer")):
            os.environ["SPECLOOM_FUSED_STACK"] = flag
            row = []
            for w in map(int, a.widths.split(",")):
                toks, pos = torch.randint(0, 1000, (1, w)), torch.arange(ctx, ctx + w)[None]
                ts = []
                for _ in range(20):
                    s = time.perf_counter()
                    m(toks, pos, kv, num_logits=0)
                    ts.append(time.perf_counter() - s)
                    kv.truncate(ctx)
                row.append(f"{w}: {1000 * sorted(ts)[4]:.2f}")
            print(f"{a.model} {name} (tokens: ms) " + ", ".join(row))


if __name__ == "__main__":
    main()
