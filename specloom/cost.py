"""The cost of a target pass on this machine: c(n, T), seconds of one pass over n rows x T tokens relative to one
plain single-sequence decode step, measured at start-up over a small grid through a KV pool (the serving path),
cached per model file, dtype, threads, host and linear kernel, checked against live passes when read, and calibrated
online with every pass the engine or server runs (`BatchCost.observe`). One mechanism for every reader: the depth
policy (depth.py), the tree tuners (`verify_cost_curve`: one row, trees up to 64 nodes), `specloom doctor`.

On hosts where verification is nearly free (oneDNN bf16: c(1, 9) ~ 1.2) drafting deep pays; where a pass costs
about its token count (AVX2-only bf16: c(1, 5) ~ 3.3) no depth does. Imports: torch, host, tokenizer (cache folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from .host import sync
from .host.contention import Contention
from .tokenizer import cache_dir, file_cache_key

ROWS = (1, 2, 4, 8, 16)
TOKENS = (1, 2, 3, 5, 9, 17)
TREE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # the one-row curve of the tree tuners


def device_tag(device: torch.device) -> str:
    """Cache-name suffix for measurements taken on `device`: empty on the CPU (names as before), else e.g.
    `-cuda-NVIDIA_H200`, so a curve measured on one device is never reused on another."""
    if device.type != "cuda":
        return ""
    return "-cuda-" + "".join(ch if ch.isalnum() else "_" for ch in torch.cuda.get_device_name(device))


def host_tag(model) -> str:
    """Cache-name part for measurements that depend on the host and on the model's linear kernel:
    `-h<host key>-<kernel tag>` (host/), and for the built kernels `-k<their sources' hash>`."""
    from .host import host_key
    from .models.native import kernels_version

    choice = getattr(model, "kernel_choice", None)
    return f"-h{host_key()}-{choice.tag if choice is not None else 'default'}-k{kernels_version()}"


def model_cache_key(model) -> str | None:
    """A cache key for the model's file (GGUF) or HF directory (its config.json and weight files); None for a
    model built in memory."""
    src = getattr(model, "source", None)
    if src is None:
        return None
    if os.path.isfile(src.path):
        return file_cache_key(src.path)
    if os.path.isdir(src.path):
        files = sorted(f for f in os.listdir(src.path) if f == "config.json" or f.endswith((".safetensors", ".bin")))
        if "config.json" in files:
            keys = "".join(file_cache_key(os.path.join(src.path, f)) for f in files)
            return hashlib.sha1(keys.encode()).hexdigest()[:16]
    return None


class BatchCost:
    """c(n, T): seconds of one pass over n rows x T tokens, relative to c(1, 1); bilinear in (n, T) on the grid,
    linear beyond its edges."""

    def __init__(self, seconds: dict[tuple[int, int], float], frozen: bool = False):
        self.seconds = seconds
        self.frozen = frozen  # True: no online calibration (a forced curve, e.g. in tests)
        self.rows = sorted({n for n, _ in seconds})
        self.tokens = sorted({t for _, t in seconds})
        self.base = seconds[(self.rows[0], self.tokens[0])]
        self.observed: dict[tuple[int, int], float] = {}  # grid point -> served passes calibrating it (weights)
        self._memo: dict[tuple[int, int], float] = {}  # c(n, t) asked since the points last changed (the depth
        # policy asks the same few every step; `observe`, `adopt` and `rescale` clear it)

    def __call__(self, n: int, t: int) -> float:
        c = self._memo.get((n, t))
        if c is None:
            c = self._memo[(n, t)] = self._interp(n, t) / self.base
        return c

    def _interp(self, n: float, t: float) -> float:
        def bracket(xs, x):
            if x <= xs[0]:
                return xs[0], xs[0], 0.0
            for a, b in zip(xs, xs[1:]):
                if x <= b:
                    return a, b, (x - a) / (b - a)
            a, b = xs[-2], xs[-1]
            return a, b, (x - a) / (b - a)  # extrapolate from the last segment

        if len(self.rows) == 1:  # a one-row curve (Engine.generate): rows scale the cost linearly
            return max(self._interp_row(t) * n / self.rows[0], 1e-9)
        n0, n1, fn = bracket(self.rows, n)
        t0, t1, ft = bracket(self.tokens, t)
        s = self.seconds

        def at(nn, tt):
            return s[(nn, tt)]

        lo = at(n0, t0) + (at(n0, t1) - at(n0, t0)) * ft
        hi = at(n1, t0) + (at(n1, t1) - at(n1, t0)) * ft
        if ft > 1:  # past the widest pass measured: never cheaper than it (a noisy last segment may slope down)
            lo, hi = max(lo, at(n0, t1)), max(hi, at(n1, t1))
        return max(lo + (hi - lo) * fn, 1e-9)

    def _interp_row(self, t: float) -> float:
        xs, r = self.tokens, self.rows[0]
        if t <= xs[0] or len(xs) == 1:
            return self.seconds[(r, xs[0])]
        for a, b in zip(xs, xs[1:]):
            if t <= b:
                break
        v = self.seconds[(r, a)] + (self.seconds[(r, b)] - self.seconds[(r, a)]) * (t - a) / (b - a)
        return max(v, self.seconds[(r, b)]) if t > b else v  # past the widest pass measured: never cheaper

    def observe(self, n: int, t: int, seconds: float, weight: float = 0.2) -> None:
        """Calibrate online with a measured pass: scale the grid points around (n, t) towards what this pass cost
        relative to the curve's prediction, each by its share in the interpolation (start-up measurements use a
        128-token context; real contexts differ, and a wide pass's attention grows with them)."""
        if self.frozen:
            return
        ratio = min(max(seconds / self._interp(n, t), 0.25), 4.0)
        self._memo = {}
        for key, share in self._corners(n, t):
            self.seconds[key] *= 1 + weight * share * (ratio - 1)
            self.observed[key] = self.observed.get(key, 0.0) + share

    def adopt(self, other: "BatchCost") -> None:
        """Take `other`'s points (a fresh measurement) in place, so that every holder of this curve (the depth
        policy) prices with them from the next step on; calibration starts afresh."""
        self.seconds = dict(other.seconds)
        self.rows, self.tokens, self.base = list(other.rows), list(other.tokens), other.base
        self.observed = {}
        self._memo = {}

    def _corners(self, n: float, t: float) -> list[tuple[tuple[int, int], float]]:
        """The grid points that (n, t) interpolates between, with their weights (clamped to the grid's edges)."""
        def bracket(xs, x):
            if len(xs) == 1 or x <= xs[0]:
                return [(xs[0], 1.0)]
            if x >= xs[-1]:
                return [(xs[-1], 1.0)]
            for a, b in zip(xs, xs[1:]):
                if x <= b:
                    f = (x - a) / (b - a)
                    return [(a, 1 - f), (b, f)]
            return [(xs[-1], 1.0)]

        rows = [(self.rows[0], 1.0)] if len(self.rows) == 1 else bracket(self.rows, n)
        return [((nn, tt), wn * wt) for nn, wn in rows for tt, wt in bracket(self.tokens, t) if wn * wt > 0]

    def rescale(self, factor: float) -> None:
        """Every point times `factor`: the same shape on a machine that now runs faster or slower."""
        self.seconds = {k: v * factor for k, v in self.seconds.items()}
        self.base *= factor
        self._memo = {}

    def relative(self, rows: int | None = None) -> dict[int, float]:
        """c(rows, T) for every T on the grid (the first row count by default), e.g. to print a one-row curve."""
        r = self.rows[0] if rows is None else rows
        return {t: self(r, t) for t in self.tokens}

    def to_json(self) -> dict:
        return {f"{n}x{t}": v for (n, t), v in self.seconds.items()}

    @classmethod
    def from_json(cls, d: dict) -> "BatchCost":
        return cls({tuple(int(x) for x in k.split("x")): v for k, v in d.items()})


def monotone(seconds: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """A pass over more rows never costs less: the cumulative maximum along the rows axis. The tokens axis is left
    as measured: on some hosts a pass over a few tokens really is cheaper than over one (oneDNN's bf16 kernels on
    an AVX-512 EPYC: c(1, 2) = 1.2, c(1, 3..5) = 0.85-0.90, c(1, 9) = 1.2, fastest of 7 interleaved passes each),
    and clamping it (as this once did, against noise) priced a 3-deep draft's verification 33 % too high there.
    The fastest of the repeats is what keeps noise out."""
    rows, tokens = sorted({n for n, _ in seconds}), sorted({t for _, t in seconds})
    out = dict(seconds)
    for i, n in enumerate(rows[1:], 1):
        for t in tokens:
            out[(n, t)] = max(out[(n, t)], out[(rows[i - 1], t)])
    return out


ONE_ROW_MIN_S = 1.5  # a one-row curve (Engine.generate's) repeats its rounds past 7 until this long has gone ...
ONE_ROW_MOST = 40  # ... up to this many: 7 rounds of a 135M model took 0.4 s, and two such curves put a 3-token
# pass at 1.21 and 1.29 decode steps (the tree chosen from it hinged on less); 40 rounds' fastest pass per width
# (12 rounds in that test) matched the medians of generation's own passes within 2 % (1.14 / 1.31 / 1.70 vs 1.165 / 1.31 / 1.755)


def measure_batch_cost(model, max_rows: int, context: int = 128, repeats: int | None = None,
                       progress=None, budget_s: float | None = None, tokens=TOKENS) -> BatchCost:
    """Time passes over n rows x T tokens through a KV pool (the serving path) after about `context` cached
    tokens (rows of slightly different lengths, as in serving: ragged passes). Every repeat times every grid point
    in turn (drift hits all alike); the fastest of the repeats (a pass slowed by another process on a shared
    host says nothing about the model: a median of slowed passes once cached a curve so steep that no drafter
    could pay), then made monotone in rows. `repeats` default: 7 for one row (Engine.generate),
    continued to `ONE_ROW_MIN_S` (at most `ONE_ROW_MOST`), 3 for a serving grid. `budget_s`: no further repeat starts once that many seconds have gone
    (one warm-up and one timed round always run; online calibration refines a curve cut short)."""
    gen = measure_in_passes(model, max_rows, context, repeats, budget_s, tokens)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            cost = done.value
            break
    if progress:
        for (n, t), v in cost.seconds.items():
            progress(n, t, v)
    return cost


@torch.inference_mode()
def _timed_pass(model, x, pos, kv) -> float:
    dev = model.device
    sync(dev)
    s = time.perf_counter()
    model(x, pos, kv)
    sync(dev)  # CUDA runs asynchronously: time the kernels, not their launch
    return time.perf_counter() - s


def measure_in_passes(model, max_rows: int, context: int = 128, repeats: int | None = None,
                      budget_s: float | None = None, tokens=TOKENS):
    """`measure_batch_cost` one pass at a time: a generator that yields after every pass (so a server can
    measure in its idle moments, cost_refresh.py) and returns the BatchCost. `budget_s` counts only the time spent
    inside it, not the pauses between passes."""
    rows = [n for n in ROWS if n <= max_rows] or [1]
    most = repeats or (ONE_ROW_MOST if rows == [1] else 3)
    repeats = repeats or (7 if rows == [1] else 3)
    dev = model.device
    with torch.inference_mode():
        pool = model.new_kv(context + max(tokens) + 1, batch=max(rows), active=0)
        for i in range(max(rows)):
            r = pool.allocate()
            m = context - i % 4
            x = torch.randint(0, model.config.vocab_size, (1, m), device=dev)
            model(x, torch.arange(m, device=dev)[None], pool.begin([r], [m]), num_logits=1)
            pool.commit(row=r)
        grid = [(n, t) for n in rows for t in tokens]
        inputs = {}
        for n, t in grid:
            lengths = torch.tensor(pool.lengths[:n], device=dev)[:, None]
            inputs[(n, t)] = (torch.randint(0, model.config.vocab_size, (n, t), device=dev),
                              lengths + torch.arange(t, device=dev)[None])
    times = {key: [] for key in grid}
    spent = 0.0
    for rep in range(most + 1):  # the first round warms up
        if rep > 1 and budget_s is not None and spent > budget_s:
            break
        if rep > repeats and spent >= ONE_ROW_MIN_S:
            break
        for n, t in grid:
            x, pos = inputs[(n, t)]
            s = time.perf_counter()
            took = _timed_pass(model, x, pos, pool.begin(range(n), [t] * n))
            spent += time.perf_counter() - s
            if rep:
                times[(n, t)].append(took)
            yield
    return BatchCost(monotone({key: min(ts) for key, ts in times.items()}))


def time_passes(model, tokens=(1,), context: int = 128, repeats: int = 5) -> dict[int, float]:
    """Fastest seconds of a one-row pass over T tokens after `context` cached tokens, for each T in `tokens`
    (interleaved, so drift hits all alike; the fastest of `repeats` is the pass without another process's
    interference). T = 1 is the cost curve's unit, now."""
    gen = time_in_passes(model, tokens, context, repeats)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def time_in_passes(model, tokens=(1,), context: int = 128, repeats: int = 5):
    """`time_passes` one pass at a time: yields after every pass, returns {T: seconds} (cost_refresh.py)."""
    dev = model.device
    with torch.inference_mode():
        kv = model.new_kv(context + max(tokens) + 1)
        x = torch.randint(0, model.config.vocab_size, (1, context), device=dev)
        model(x, torch.arange(context, device=dev)[None], kv, num_logits=1)
        kv.commit()
        inputs = {t: (torch.randint(0, model.config.vocab_size, (1, t), device=dev),
                      torch.arange(context, context + t, device=dev)[None]) for t in tokens}
    times: dict[int, list[float]] = {t: [] for t in tokens}
    for rep in range(repeats + 1):  # the first round warms up
        for t in tokens:
            took = _timed_pass(model, *inputs[t], kv)
            kv.truncate(context)
            if rep:
                times[t].append(took)
            yield
    return {t: min(ts) for t, ts in times.items()}


CURVE_VERSION = "2"  # in the cache file's name: 2 = tokens axis no longer clamped (curves cached before are measured again)
MEASURE_BUDGET_S = 60.0  # the most a verify-cost measurement may take before its repeats stop
SHAPE_CHECK_TOKENS = (3, 9)  # a cached curve is checked at c(1, 3) and c(1, 9) against a fresh probe ...
SHAPE_TOLERANCE = 1.25  # ... and measured again when what a pass costs beyond one token differs by this factor ...
SHAPE_SLACK = 0.05  # ... and by more than this many decode steps (a GPU's or AMX host's near-free rows: noise)


def shape_moved(then: float, now: float) -> bool:
    """Whether a pass's cost in decode steps (c(n, t) / c(1, 1)) moved from `then` (cached) to `now`: judged on
    its excess over one decode step, c - 1, which is what prices every draft. A ratio of the whole cost hid the
    curve this host cached while a data generator shared a core: a 3-token pass at 1.15 decode steps where the
    quiet host shows 1.31 is 14 % on the whole pass (within 1.3) but half the rows' cost, enough to choose a
    wider tree that generation then runs ~4 % slower than the chain it displaced."""
    a, b = max(then - 1.0, 0.0), max(now - 1.0, 0.0)
    return abs(a - b) > SHAPE_SLACK and max(a, b) > SHAPE_TOLERANCE * min(a, b)


def batch_cost_cached(model, max_rows: int, refresh: bool = False, log=None,
                      budget_s: float | None = MEASURE_BUDGET_S) -> BatchCost:
    """`measure_batch_cost`, cached in ~/.cache/specloom/verify_cost/ per model file, dtype, threads, rows, host
    (CPU, flags, torch) and linear kernel. A measurement is bounded by `budget_s` and says (through `log`) that it
    runs, where it is cached and how long it took; a cache hit says where it was read from."""
    path = _cache_path(model, "batch", f"-r{max_rows}")
    if path:
        cost = None
        if not refresh and os.path.isfile(path):
            try:
                cost = _read(path)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError):
                if log:
                    log(f"verify cost curve cache {path} is unreadable: measuring it again")
                cost = None
        if cost is not None:
            # the cached shape, anchored to how fast the machine runs now (a curve measured while the host was
            # busier would otherwise take many passes of online calibration to come back), and checked at a few
            # multi-token points: a cached shape that this host no longer shows is measured again
            watch = Contention()
            now = time_passes(model, (1, *SHAPE_CHECK_TOKENS), repeats=7)

            def disagree(now):
                off = [(t, cost(cost.rows[0], t), now[t] / now[1]) for t in SHAPE_CHECK_TOKENS]
                return [(t, c, f) for t, c, f in off if shape_moved(c, f)]

            cost.rescale(now[1] / cost.seconds[(cost.rows[0], cost.tokens[0])])
            # (the probe is the fastest of 7 interleaved passes per size: the pass least slowed by other work)
            bad = disagree(now)
            if bad:  # a second look before a minute of measuring: a burst of other work is not a new host
                again = time_passes(model, (1, *SHAPE_CHECK_TOKENS), repeats=7)
                now = {t: min(now[t], again[t]) for t in now}
                cost.rescale(now[1] / cost.seconds[(cost.rows[0], cost.tokens[0])])
                bad = disagree(now)
            others = watch.busy_host() if bad else ""
            if not bad or others:  # a check taken beside other work says nothing against a curve cached quiet
                if log:
                    log(f"verify cost curve read from {path}" + (
                        f" (its check disagreed, but {others}: kept)" if others else ""))
                return cost
            if log:
                t, c, f = bad[0]
                log(f"cached verify cost curve {path} disagrees with this host now (a {t}-token pass: {c:.2f} "
                    f"decode steps cached, {f:.2f} measured now); measuring it again")
    if log:
        where = f"cached at {path}" if path else "not cached: the model was built in memory"
        bound = f", at most ~{budget_s:.0f} s" if budget_s is not None else ""
        log(f"measuring verify cost curve for up to {max_rows} rows{bound} (once per model, dtype, host and "
            f"kernel; {where}) ...")
    t0 = time.perf_counter()
    watch = Contention()
    cost = measure_batch_cost(model, max_rows, budget_s=budget_s)
    others = watch.busy_host()  # another process sharing the cores compresses the whole curve, not one pass
    if busy_shape(cost):  # a narrower pass far dearer than a wider one: another process shared a core
        if log:
            log(f"verify cost curve looks measured on a busy host ({busy_shape(cost)}): measuring it again")
        cost = measure_batch_cost(model, max_rows, budget_s=budget_s)
    if log:
        log(f"verify cost curve measured in {time.perf_counter() - t0:.1f} s")
    if path and not busy_shape(cost) and not others:
        _write(path, cost)
    elif path and log:
        log(f"verify cost curve measured on a busy host ({busy_shape(cost) or others}): used for this run, "
            f"not cached (measured again on the next load)")
    return cost


BUSY_RATIO = 1.6  # no host shows a pass over fewer tokens costing this many times one over more (1.33 seen)
BUSY_MIN_S = 0.002


def busy_shape(cost: BatchCost) -> str:
    """"" when the curve could be a host's own; else the pair of passes that says another process was running
    during the measurement (a 2-token pass 2.3x a 3-token one was measured, and cached, with a data generator
    sharing a core: a curve under which every drafter looked worthwhile or worthless by chance). Passes under
    `BUSY_MIN_S` (a toy model's) are all noise and never judged."""
    if cost.base < BUSY_MIN_S:
        return ""
    for n in cost.rows:
        ts = cost.tokens
        for i, a in enumerate(ts[:-1]):
            b = min(ts[i + 1:], key=lambda t: cost.seconds[(n, t)])
            if cost.seconds[(n, a)] > BUSY_RATIO * cost.seconds[(n, b)]:
                return f"{n} x {a} tokens took {cost.seconds[(n, a)] / cost.seconds[(n, b)]:.1f}x {n} x {b}"
    return ""


def verify_cost_curve(model, refresh: bool = False) -> BatchCost:
    """The one-row curve of the tree tuners (scripts/tune_tree.py, scripts/choose_eagle_tree.py, the EAGLE shape
    tuner): c(1, n) for trees of up to 64 nodes after 256 cached tokens, measured like the serving grid and cached
    beside it (`tree`-prefixed). Read it as `curve(1, nodes)`."""
    path = _cache_path(model, "tree")
    if path and not refresh and os.path.isfile(path):
        try:
            return _read(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError):
            # unreadable (cut short, corrupt): named, measured again below and rewritten
            import logging

            logging.getLogger("specloom").warning("specloom: tree cost curve cache %s is unreadable: measuring "
                                                  "it again", path)
    cost = measure_batch_cost(model, 1, context=256, tokens=TREE_SIZES)
    if path:
        _write(path, cost)
    return cost


def _cache_path(model, kind: str, rows: str = "") -> str | None:
    """~/.cache/specloom/verify_cost/<kind><version>-<model key>-<dtype>-t<threads><rows>-h<host>-<kernel>.json;
    None for a model built in memory."""
    key = model_cache_key(model)
    if not key:
        return None
    name = (f"{kind}{CURVE_VERSION}-{key}-{str(model.dtype).replace('torch.', '')}-t{torch.get_num_threads()}"
            f"{rows}{host_tag(model)}{device_tag(model.device)}.json")
    return os.path.join(cache_dir(), "verify_cost", name)


def _read(path: str) -> BatchCost:
    with open(path) as f:
        cost = BatchCost.from_json(json.load(f))
    cost(cost.rows[0], cost.tokens[0])  # a curve that cannot be evaluated raises here, not at the first step
    return cost


def _write(path: str, cost: BatchCost) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(cost.to_json(), f, indent=1)
