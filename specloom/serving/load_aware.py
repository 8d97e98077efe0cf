"""Load-aware speculation: how deep to draft this step, from the batch size and each request's recent acceptance.

A verification pass over n rows of T tokens costs c(n, T) (relative to one plain single-sequence decode step),
measured on this machine at start-up over a small grid and cached (`measure_batch_cost`), then calibrated with
every pass the server runs (`BatchCost.observe`). Drafting costs d per depth per request (measured online). A request with per-token acceptance alpha emits on average
E(alpha, k) = 1 + alpha + ... + alpha^k tokens from a k-deep chain. Each step the policy picks the depth k that
maximises the batch's expected tokens per unit time

    sum_r E(alpha_r, k) / (c(n, 1 + nodes(k)) + n * k * d)

(k = 0 is plain decoding: speculation switches itself off when the machine is busy), then lowers k for each
request whose own acceptance does not pay for its share. Acceptance per request is a decayed count of accepted
drafts and rejections (the maximum-likelihood alpha of a geometric run), started from the running average of all
requests. Modes: "off" (never draft), "fixed" (always the configured depth), "load_aware" (this policy).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch

ROWS = (1, 2, 4, 8, 16)
TOKENS = (1, 2, 3, 5, 9, 17)
MODES = ("off", "fixed", "load_aware")


def geometric_tokens(alpha: float, k: int) -> float:
    """Expected tokens from one step with a k-deep chain whose drafts are each accepted with probability alpha."""
    return float(sum(alpha ** j for j in range(k + 1)))


class Acceptance:
    """Decayed counts of accepted drafts and of steps that ended in a rejection: alpha = a / (a + r)."""

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.8):
        self.a, self.r, self.decay = prior * weight, (1 - prior) * weight, decay

    def update(self, proposed_depth: int, accepted: int) -> None:
        if proposed_depth <= 0:
            return
        self.a = self.a * self.decay + accepted
        self.r = self.r * self.decay + (1.0 if accepted < proposed_depth else 0.0)

    @property
    def alpha(self) -> float:
        return self.a / (self.a + self.r) if self.a + self.r > 0 else 0.0


class BatchCost:
    """c(n, T): seconds of one pass over n rows x T tokens, relative to c(1, 1); bilinear in (n, T) on the grid,
    linear beyond its edges."""

    def __init__(self, seconds: dict[tuple[int, int], float]):
        self.seconds = seconds
        self.rows = sorted({n for n, _ in seconds})
        self.tokens = sorted({t for _, t in seconds})
        self.base = seconds[(self.rows[0], self.tokens[0])]

    def __call__(self, n: int, t: int) -> float:
        return self._interp(n, t) / self.base

    def _interp(self, n: float, t: float) -> float:
        def bracket(xs, x):
            if x <= xs[0]:
                return xs[0], xs[0], 0.0
            for a, b in zip(xs, xs[1:]):
                if x <= b:
                    return a, b, (x - a) / (b - a)
            a, b = xs[-2], xs[-1]
            return a, b, (x - a) / (b - a)  # extrapolate from the last segment

        n0, n1, fn = bracket(self.rows, n)
        t0, t1, ft = bracket(self.tokens, t)
        s = self.seconds

        def at(nn, tt):
            return s[(nn, tt)]

        lo = at(n0, t0) + (at(n0, t1) - at(n0, t0)) * ft
        hi = at(n1, t0) + (at(n1, t1) - at(n1, t0)) * ft
        return max(lo + (hi - lo) * fn, 1e-9)

    def observe(self, n: int, t: int, seconds: float, weight: float = 0.1) -> None:
        """Calibrate online with a measured pass: scale the nearest grid point towards what this pass cost
        relative to the curve's prediction (start-up measurements use a 128-token context; real contexts differ)."""
        n0 = min(self.rows, key=lambda r: abs(math.log(r / n)))
        t0 = min(self.tokens, key=lambda x: abs(x - t))
        ratio = seconds / self._interp(n, t)
        self.seconds[(n0, t0)] *= (1 - weight) + weight * min(max(ratio, 0.25), 4.0)

    def to_json(self) -> dict:
        return {f"{n}x{t}": v for (n, t), v in self.seconds.items()}

    @classmethod
    def from_json(cls, d: dict) -> "BatchCost":
        return cls({tuple(int(x) for x in k.split("x")): v for k, v in d.items()})


@torch.inference_mode()
def measure_batch_cost(model, max_rows: int, context: int = 128, repeats: int = 3, progress=None) -> BatchCost:
    """Time passes over n rows x T tokens through a KV pool (the serving path) after about `context` cached
    tokens (rows of slightly different lengths, as in serving: ragged passes)."""
    from ..bench.verify_cost import sync

    rows = [n for n in ROWS if n <= max_rows] or [1]
    pool = model.new_kv(context + max(TOKENS) + 1, batch=max(rows), active=0)
    dev = model.device
    for i in range(max(rows)):
        r = pool.allocate()
        m = context - i % 4
        x = torch.randint(0, model.config.vocab_size, (1, m), device=dev)
        model(x, torch.arange(m, device=dev)[None], pool.begin([r], [m]), num_logits=1)
        pool.commit(row=r)
    out = {}
    for n in rows:
        for t in TOKENS:
            x = torch.randint(0, model.config.vocab_size, (n, t), device=dev)
            lengths = torch.tensor(pool.lengths[:n], device=dev)[:, None]
            pos = lengths + torch.arange(t, device=dev)[None]
            times = []
            for _ in range(repeats + 1):
                sync(dev)
                s = time.perf_counter()
                model(x, pos, pool.begin(range(n), [t] * n))
                sync(dev)  # CUDA runs asynchronously: time the kernels, not their launch
                times.append(time.perf_counter() - s)
            out[(n, t)] = statistics.median(times[1:])
            if progress:
                progress(n, t, out[(n, t)])
    return BatchCost(out)


def batch_cost_cached(model, max_rows: int, refresh: bool = False, log=None) -> BatchCost:
    """`measure_batch_cost`, cached in ~/.cache/specloom/verify_cost/ per model file, dtype, threads and rows."""
    from ..bench.verify_cost import device_tag
    from ..tokenizer import cache_dir, file_cache_key

    src = getattr(model, "source", None)
    path = None
    if src is not None and os.path.isfile(src.path):
        name = (f"batch-{file_cache_key(src.path)}-{str(model.dtype).replace('torch.', '')}"
                f"-t{torch.get_num_threads()}-r{max_rows}{device_tag(model.device)}.json")
        path = os.path.join(cache_dir(), "verify_cost", name)
        if not refresh and os.path.isfile(path):
            with open(path) as f:
                return BatchCost.from_json(json.load(f))
    if log:
        log("measuring the batch verify-cost curve (once per model, dtype and thread count)")
    cost = measure_batch_cost(model, max_rows)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cost.to_json(), f, indent=1)
    return cost


class DepthPolicy:
    def __init__(self, mode: str, max_k: int, cost: BatchCost | None = None):
        if mode not in MODES:
            raise ValueError(f"speculation mode must be one of {MODES}, got {mode!r}")
        if mode == "load_aware" and cost is None:
            raise ValueError("load-aware speculation needs a batch cost curve")
        self.mode, self.max_k, self.cost = mode, max_k, cost
        self.draft_cost = 0.0  # drafting time per depth per request, relative to c(1, 1) (EMA)
        self.nodes_per_depth = 1.0  # tree nodes per unit of depth (1 for chains; EMA over proposed trees)
        self.global_alpha = Acceptance(prior=0.5, weight=2.0, decay=0.98)
        self.last_k = 0

    def new_acceptance(self) -> Acceptance:
        return Acceptance(prior=self.global_alpha.alpha, weight=2.0)

    def observe(self, acc: Acceptance, depth: int, nodes: int, accepted: int, draft_seconds: float,
                step_seconds_1x1: float | None) -> None:
        if depth <= 0:
            return
        acc.update(depth, accepted)
        self.global_alpha.update(depth, accepted)
        self.nodes_per_depth = 0.9 * self.nodes_per_depth + 0.1 * (nodes - 1) / depth
        if step_seconds_1x1:
            self.draft_cost = 0.9 * self.draft_cost + 0.1 * draft_seconds / depth / step_seconds_1x1

    def _rate(self, alphas: list[float], k: int, n: int) -> float:
        nodes = 1 + math.ceil(k * self.nodes_per_depth)
        return sum(geometric_tokens(a, k) for a in alphas) / (self.cost(n, nodes) + n * k * self.draft_cost)

    def choose(self, alphas: list[float], caps: list[int]) -> list[int]:
        """Depth per request (each at most its cap: the drafter's depth and the tokens it may still emit)."""
        if self.mode == "off" or not alphas:
            ks = [0] * len(alphas)
        elif self.mode == "fixed":
            ks = [min(self.max_k, c) for c in caps]
        else:
            n = len(alphas)
            top = min(self.max_k, max(caps))
            k_batch = max(range(top + 1), key=lambda k: (self._rate(alphas, k, n), -k))
            ks = []
            for a, c in zip(alphas, caps):
                share = [geometric_tokens(a, k) / (self.cost(n, 1 + math.ceil(k * self.nodes_per_depth)) / n
                                                   + k * self.draft_cost) for k in range(min(k_batch, c) + 1)]
                ks.append(max(range(len(share)), key=lambda k: (share[k], -k)))
        self.last_k = max(ks, default=0)
        return ks
