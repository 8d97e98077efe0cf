"""Whole-pass times of a target under each named linear kernel, in one process (issue 37): a decode step and a
9-token verification pass after 128 cached tokens, the 6th fastest of 20 repeats, and the resident set after
each load.

    python scripts/pass_times.py gemma3-270m --kernels ggml,onednn
"""

import argparse
import time

import torch

from specloom.loading import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--kernels", default="ggml,onednn")
    ap.add_argument("--widths", default="1,9")
    a = ap.parse_args()
    for k in a.kernels.split(","):
        m, _ = load_target(a.model, "bf16", progress=False, kernel=k)
        kv, ctx = m.new_kv(200), 128
        with torch.inference_mode():
            m(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], kv, num_logits=1)
            kv.commit()
            for w in map(int, a.widths.split(",")):
                toks, pos = torch.randint(0, 1000, (1, w)), torch.arange(ctx, ctx + w)[None]
                ts = []
                for _ in range(20):
                    s = time.perf_counter()
                    m(toks, pos, kv, num_logits=w)
                    ts.append(time.perf_counter() - s)
                    kv.truncate(ctx)
                print(f"{a.model} {k} {w}-token pass: {1000 * sorted(ts)[5]:.2f} ms")
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        print(f"{a.model} {k} resident {rss / 1024:.0f} MiB (process)")
        del m


if __name__ == "__main__":
    main()
