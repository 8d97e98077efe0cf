"""Prefill time of a target for prompts of a few lengths, best of 4, 2 threads (BENCHMARKS.md, the host without
AMX). Run from two checkouts (PYTHONPATH=<checkout>) to compare kernels.

    python scripts/prefill_times.py smollm2-135m --lengths 128,512
"""

import argparse
import time

import torch

import specloom.engine as E
from specloom.step import prefill_chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    eng = E.load(a.model, None, progress=False)
    for T in map(int, a.lengths.split(",")):
        ids = list(range(1000, 1000 + T))
        best = float("inf")
        for _ in range(4):
            kv = eng._kv_for(T + 8)
            row = kv.allocate() if kv.active == 0 else 0
            t = time.perf_counter()
            with torch.inference_mode():
                prefill_chunk(eng.model, kv, row, ids, 0, (), {})
            best = min(best, time.perf_counter() - t)
        print(f"prefill {T} tokens: {1000 * best:.0f} ms ({T / best:.0f} tok/s)")


if __name__ == "__main__":
    main()
