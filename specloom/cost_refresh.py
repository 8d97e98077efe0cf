"""A server ready at once on the verify-cost figures it has, which checks, measures and refreshes them in its idle
moments (the scheduler calls `CurveRefresh.step` only while no request is queued or running: a request that arrives
waits for one pass at most).

- A cached curve is used as read; in idle time it is checked at a few widths (cost.SHAPE_CHECK_TOKENS) and
  rescaled to how fast the host runs now, or measured again when its shape disagrees.
- Without a cache, the server starts on a one-row probe of a few widths (~0.5 s for a 135M model; a pass over n
  rows x T tokens priced as one row of n x T tokens) and measures the full grid in idle time, then caches it.
- Afterwards it watches the live curve (calibrated by every served pass, `BatchCost.observe`): when the live shape
  contradicts the cached one, the curve is measured again in idle time (at most once per `REMEASURE_AFTER_S`) and
  the cache rewritten.

Imports: cost.py, host/contention.py.
"""

from __future__ import annotations

import time

from . import cost as cost_mod
from .cost import BatchCost
from .host.contention import Contention

QUICK_TOKENS = (1, 2, 3, 5, 9, 17, 33, 65)  # the start-up probe's widths (one row); rows x tokens beyond: linear
SLICE_S = 0.05  # passes per idle slice: no new pass starts after this long
WATCH_EVERY_S = 5.0  # how often (while idle) the live curve is compared with the cached one
MIN_OBSERVED = 32.0  # served passes (interpolation weight) at a grid point before its live figure counts
REMEASURE_AFTER_S = 1800.0  # a contradicted curve is measured again at most this often


def quick_curve(model, max_rows: int, repeats: int = 3) -> BatchCost:
    """A start-up curve from one row: the fastest of `repeats` interleaved passes at each of QUICK_TOKENS after 128
    cached tokens, and c(n, T) ~ c(1, n x T) for the other rows (attention over n contexts is not priced: the
    full measurement replaces this within seconds of idle time)."""
    widths = [t for t in QUICK_TOKENS if t <= max(cost_mod.TOKENS) * max_rows] or [1]
    one = cost_mod.time_passes(model, tuple(widths), repeats=repeats)
    row = BatchCost({(1, t): s for t, s in one.items()})
    rows = [n for n in cost_mod.ROWS if n <= max_rows] or [1]
    seconds = {(n, t): row._interp_row(n * t) for n in rows for t in cost_mod.TOKENS}
    return BatchCost(cost_mod.monotone(seconds))


class CurveRefresh:
    """The idle-time work on `live` (the BatchCost the depth policy uses); `path` its cache file (None: a model
    built in memory, nothing cached). `checked`: True when `live` was read from the cache and is to be checked, False
    when it is a quick probe to be replaced by a full measurement. `log(message)` says what happens."""

    def __init__(self, model, max_rows: int, live: BatchCost, path: str | None, cached: bool, log=None):
        self.model, self.max_rows, self.live, self.path = model, max_rows, live, path
        self.log = log or (lambda m: None)
        self.reference = BatchCost(dict(live.seconds))  # the shape the cache holds (or will hold)
        self._work = self._check() if cached else self._measure("the full curve")
        self._next_watch = 0.0
        self._last_measure = -REMEASURE_AFTER_S
        self.measurements = 0  # full measurements finished (tests, logs)
        self.state = "checking" if cached else "measuring"

    def step(self, slice_s: float = SLICE_S) -> float | None:
        """Run passes for up to `slice_s`; returns how long the caller may wait before the next call (0: work is
        left), or None never (the watch goes on while the server lives)."""
        if self._work is None:
            now = time.monotonic()
            if now < self._next_watch:
                return self._next_watch - now
            self._next_watch = now + WATCH_EVERY_S
            why = self.contradiction()
            if why and now - self._last_measure >= REMEASURE_AFTER_S:
                self.log(f"verify cost curve: live passes contradict the cached one ({why}); measuring it again in "
                         "idle time")
                self._work = self._measure("a fresh curve")
                self.state = "measuring"
            else:
                return WATCH_EVERY_S
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < slice_s:
            try:
                next(self._work)
            except StopIteration:
                self._work = None
                self.state = "watching"
                return WATCH_EVERY_S
        return 0.0

    def contradiction(self) -> str:
        """"" while the live curve (calibrated by served passes) keeps the cached shape; else the grid point whose
        cost relative to a 1 x 1 pass moved (cost.shape_moved), both well observed."""
        live, ref = self.live, self.reference
        base = (live.rows[0], live.tokens[0])
        if live.observed.get(base, 0.0) < MIN_OBSERVED:
            return ""
        for key, weight in sorted(live.observed.items()):
            if key == base or weight < MIN_OBSERVED or key not in ref.seconds:
                continue
            now = live.seconds[key] / live.seconds[base]
            then = ref.seconds[key] / ref.seconds[base]
            if cost_mod.shape_moved(then, now):
                return f"{key[0]} x {key[1]} tokens: {now:.2f} passes of 1 x 1 live, {then:.2f} cached"
        return ""

    # -- the work, one pass per `next` ------------------------------------------------------------------------
    def _check(self):
        """Time 1 x 1 and the shape-check widths (7 interleaved repeats, one pass per `next`): rescale the live
        curve to the host's speed now, or measure it again when the shape disagrees (cost.batch_cost_cached's
        rule, off the start-up path)."""
        widths = (1, *cost_mod.SHAPE_CHECK_TOKENS)
        watch = Contention()
        now = yield from cost_mod.time_in_passes(self.model, widths, repeats=7)
        ref = self.reference
        r0, t0 = ref.rows[0], ref.tokens[0]
        off = [(t, ref(r0, t), now[t] / now[1]) for t in cost_mod.SHAPE_CHECK_TOKENS]
        bad = [(t, c, f) for t, c, f in off if cost_mod.shape_moved(c, f)]
        others = watch.busy_host() if bad else ""
        if others:  # a check taken beside other work says nothing against a curve cached quiet
            self.log(f"verify cost curve checked in idle time: it disagreed, but {others}: the cached one kept")
            return
        if not bad:
            factor = now[1] / ref.seconds[(r0, t0)]
            self.live.rescale(factor)
            self.reference.rescale(factor)
            self.log(f"verify cost curve checked in idle time: the cached shape holds (host speed x{1 / factor:.2f})")
            return
        t, c, f = bad[0]
        self.log(f"verify cost curve checked in idle time: the cached one disagrees with this host now (a {t}-token "
                 f"pass: {c:.2f} decode steps cached, {f:.2f} measured now); measuring it again in idle time")
        self.state = "measuring"
        yield from self._measure("a fresh curve")

    def _measure(self, what: str):
        """The full grid (cost.measure_in_passes), then adopted by the live curve and cached; a curve that looks
        measured on a busy host is measured once more and never cached."""
        t0 = time.monotonic()
        self._last_measure = t0
        for attempt in range(2):
            watch = Contention()
            new = yield from cost_mod.measure_in_passes(self.model, self.max_rows,
                                                        budget_s=cost_mod.MEASURE_BUDGET_S)
            busy = cost_mod.busy_shape(new) or watch.busy_host()
            if not busy:
                break
            self.log(f"verify cost curve measured in idle time looks measured on a busy host ({busy})"
                     + ("; measuring it again" if attempt == 0 else "; used, not cached"))
        self.live.adopt(new)
        self.reference = BatchCost(dict(new.seconds))
        self.measurements += 1
        where = "not cached: the model was built in memory" if not self.path else (
            f"cached at {self.path}" if not busy else "not cached")
        if self.path and not busy:
            cost_mod._write(self.path, new)
        self.log(f"verify cost curve: {what} measured in idle time ({time.monotonic() - t0:.1f} s since it "
                 f"began); {where}")


def startup_curve(model, max_rows: int, log=None) -> tuple[BatchCost, CurveRefresh]:
    """The curve a server starts on at once (cached: as read; none: `quick_curve`) and the idle-time work that
    checks or replaces it."""
    path = cost_mod._cache_path(model, "batch", f"-r{max_rows}")
    log = log or (lambda m: None)
    if path:
        try:
            cost = cost_mod._read(path)
        except FileNotFoundError:
            cost = None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError):
            log(f"verify cost curve cache {path} is unreadable: measuring it again in idle time")
            cost = None
        if cost is not None:
            log(f"verify cost curve read from {path}; checked in idle time")
            return cost, CurveRefresh(model, max_rows, cost, path, cached=True, log=log)
    t0 = time.perf_counter()
    cost = quick_curve(model, max_rows)
    log(f"verify cost curve: starting on a one-row probe ({time.perf_counter() - t0:.1f} s); the full curve for up to "
        f"{max_rows} rows is measured in idle time")
    return cost, CurveRefresh(model, max_rows, cost, path, cached=False, log=log)
