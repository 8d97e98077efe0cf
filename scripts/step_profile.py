"""Where a decode step (and a verification pass) of a GGUF target goes, with the fused decoder stack
(models/fused_stack.py): the weight matmuls (the stack's linears, timed inside the C loop, and the LM head), the
attention, and everything else (embedding, norms, RoPE, KV writes, silu, Python), after 128 cached tokens; the
sums over 40 passes of each width (issue 37's "non-matmul <= 25 % of a decode step").

    python scripts/step_profile.py smollm2-135m --widths 1,9
"""

import argparse
import time

import torch

from specloom.loading import load_target
from specloom.models import fused_stack, ggml_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--widths", default="1,9")
    ap.add_argument("--passes", type=int, default=40)
    a = ap.parse_args()
    m, _ = load_target(a.model, "bf16", progress=False, kernel="ggml")
    kv, ctx = m.new_kv(400), 128
    head = [0.0]
    real = ggml_linear.GGMLWeight.matmul_ptr

    def timed(self, *args):
        s = time.perf_counter()
        real(self, *args)
        head[0] += time.perf_counter() - s

    ggml_linear.GGMLWeight.matmul_ptr = timed  # outside the stack: the LM head
    with torch.inference_mode():
        m(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], kv, num_logits=1)
        kv.commit()
        for w in map(int, a.widths.split(",")):
            toks, pos = torch.randint(0, 1000, (1, w)), torch.arange(ctx, ctx + w)[None]
            for _ in range(5):
                m(toks, pos, kv, num_logits=w)
                kv.truncate(ctx)
            fused_stack.PROFILE, head[0], wall = [0.0, 0.0, 0.0], 0.0, 0.0
            for _ in range(a.passes):
                s = time.perf_counter()
                m(toks, pos, kv, num_logits=w)
                wall += time.perf_counter() - s
                kv.truncate(ctx)
            lin, att, stack = fused_stack.PROFILE
            fused_stack.PROFILE = None
            if stack == 0:
                print(f"{w}-token pass: the fused stack did not run (not a GGUF Llama-family target held as shipped?)")
                continue
            mm, n = lin + head[0], a.passes
            print(f"{a.model} {w}-token pass: {1000 * wall / n:.2f} ms = matmuls {1000 * mm / n:.2f} "
                  f"(layers {1000 * lin / n:.2f}, head {1000 * head[0] / n:.2f}) + attention {1000 * att / n:.2f} "
                  f"+ other {1000 * (wall - mm - att) / n:.2f} (in the C loop {1000 * (stack - lin - att) / n:.2f}, "
                  f"outside it {1000 * (wall - stack - head[0]) / n:.2f}); not matmul: {100 * (1 - mm / wall):.0f} %")


if __name__ == "__main__":
    main()
