"""Profile: what one drafted token costs the Qwen2.5-Coder-0.5B draft model with its full head and with a reduced
draft vocabulary, with its host-fitted linear kernel and with others (`"draft_kernel"`), against one plain decode
step of the 1.5B target (bf16, one row, interleaved repetitions).

    python scripts/draft_vocab_cost.py [--sizes 16384 32768 65536] [--kernels int8] [--reps 30]
"""

import argparse
import statistics
import time

import torch

from specloom.drafters.draft_model.drafter import DraftModelDrafter
from specloom.drafters.token_map import reduced_vocabulary
from specloom.loading import load_target


def step_ms(model, head, ctx_len=64):
    kv = model.new_kv(ctx_len + 2, dtype=None, batch=1)
    L = model.config.num_layers
    x = torch.randint(100, 1000, (1, ctx_len))
    with torch.inference_mode():
        model(x, torch.arange(ctx_len)[None], kv.begin([0], [ctx_len]), num_logits=1)
        kv.commit(row=0)

        def one():
            t0 = time.perf_counter()
            h = model(x[:, :1], torch.tensor([[ctx_len]]), kv.begin([0], [1]), capture=(L,), num_logits=0).hidden[L]
            head(h[:, -1])
            kv.truncate(ctx_len, row=0)
            return (time.perf_counter() - t0) * 1e3
    return one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--kernels", nargs="*", default=["int8"], help="draft kernels besides the host-fitted one")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    target, tok = load_target("qwen2.5-coder-1.5b", torch.bfloat16, progress=False)
    draft, _ = load_target("qwen2.5-coder-0.5b", torch.bfloat16, progress=False)
    runs = {"target 1.5B (full head)": step_ms(target, target.logits),
            "draft 0.5B full head (151936)": step_ms(draft, draft.logits)}
    drafts = {"auto": draft} | {k: load_target("qwen2.5-coder-0.5b", torch.bfloat16, progress=False, kernel=k)[0]
                                for k in a.kernels}
    for kern, m in drafts.items():
        if kern != "auto":
            runs[f"draft 0.5B {kern} full head"] = step_ms(m, m.logits)
        for n in a.sizes:
            vocab = reduced_vocabulary(n, None, tok, m.config.vocab_size, tuple(tok.eos_token_ids))
            d = DraftModelDrafter(m, 3, 1, vocab)
            runs[f"draft 0.5B {kern} draft_vocab {n}"] = step_ms(m, d._logits)
    times = {k: [] for k in runs}
    for _ in range(3):  # warm-up
        for f in runs.values():
            f()
    for _ in range(a.reps):
        for k, f in runs.items():
            times[k].append(f())
    base = statistics.median(times["target 1.5B (full head)"])
    print(f"target kernel: {target.kernel_choice.tag}; draft kernel (auto): {draft.kernel_choice.tag}")
    print(f"{'pass':40s} {'ms (median)':>12s} {'x target step':>14s}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"{k:40s} {m:12.1f} {m / base:14.2f}")


if __name__ == "__main__":
    main()
