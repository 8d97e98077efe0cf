"""Where a plain decode step's time goes: torch.profiler over 20 decode steps (after 10 warm-up steps and a 200-token
prefill) and the median step time over 50 steps.

    python scripts/profile_decode.py [smollm2-135m] [bf16]
"""

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import specloom


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bf16"
    engine = specloom.load(model, dtype=dtype, progress=False)
    m = engine.model
    kv = m.new_kv(1024)
    engine.prefill(list(range(100, 300)), kv)
    tok = torch.tensor([[5]])

    def step(i: int) -> None:
        m(tok, torch.tensor([[200 + i]]), kv)
        kv.commit()

    with torch.inference_mode():
        for i in range(10):
            step(i)
        times = []
        for i in range(50):
            t = time.perf_counter()
            step(10 + i)
            times.append(time.perf_counter() - t)
        print(f"median {statistics.median(times) * 1000:.2f} ms/step, min {min(times) * 1000:.2f} ms")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(20):
                step(60 + i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
