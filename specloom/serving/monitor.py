"""The live acceptance monitor of `specloom serve`: rolling acceptance over recent verification steps, compared with
a start-up figure, and a degraded flag for a sustained drop.

A drafter can load, run and stay exact while its acceptance collapses: a drafter made for another copy of the
target (another quantization), a fine-tuned target, or acceptance that decays over hours of serving. Nothing
raises; only the acceptance shows it. The scheduler feeds the monitor every step (`observe`): each row that
drafted is one *drafted step* (its draft's depth and how many of its tokens were accepted). Over the last
`window` drafted steps (all requests together) the monitor keeps

* the acceptance rate alpha = accepted draft tokens / draft positions the verifier examined (the accepted ones
  plus the one that was rejected, if any) -- the per-token acceptance of a geometric run, the same quantity as
  the load-aware policy's `Acceptance.alpha`; unlike tokens per step (tau) it does not change with the depth the
  policy chooses, so a busy server drafting shallower is not a drop;
* the acceptance per position: drafts whose token at position i was accepted / drafts that reached position i
  (as `bench` and the drafter manifests' `acceptance_per_position`).

The start-up figure is the drafter's expected tau (a constructor argument: `specloom doctor`'s probe, or the
drafter manifest's measured `mean_accepted_length` as fallback, `drafters.checkpoint.drafter_prior_tau`), turned into
the alpha of the same k-deep geometric run (`tau_to_alpha`, as the policy's prior). Every `check_every` drafted
steps, once the window holds `min_steps`, it counts as *low* when alpha is below `fraction` x the expected alpha
**and** significantly so (the gap exceeds `z` binomial standard errors at the expected alpha, over the positions
examined): a small sample or a small expected figure does not alarm by chance. `consecutive` low checks in a row
set `degraded`; as many checks in a row that are not low clear it. Entering the degraded state logs one
warning naming the figures; while it lasts (or after flapping) at most one per `warn_interval_s`.

Defaults (why): window 512 drafted steps (32 steps of a 16-row batch, a few hundred tokens of one request: long
enough for a standard error of about 0.02, short enough to see a swap within minutes); fraction 0.5 (a mismatched
drafter falls far below half -- the DFlash case of issue 16 went from 93 % to 14-28 % -- while the Spec-Bench
categories of the bundled EAGLE-3 (BENCHMARKS.md) stay above half of its manifest's 0.51 except translation,
tau 1.25 -> 0.21: a translation-only workload is flagged, and rightly so, the drafter does not pay there, 0.88x);
z 3 and 3 consecutive checks 64 drafted steps apart, judged from 128 drafted steps on (a sudden total collapse
is seen after ~256 drafted steps plus what it takes the window to turn over; a normal workload does not flap,
and a small start-up figure is not undercut by chance, tests/test_acceptance_monitor.py); one warning per 300 s.
Without a start-up figure (n-gram, suffix, draft_model: no manifest) the acceptance gauges are kept but nothing
is judged degraded.

The scheduler (scheduler.py `_monitor`) feeds it every step and, under load-aware speculation, lets the policy judge
new requests by the measured acceptance while it is degraded (the policy's prior), so a degraded drafter costs
about what plain decoding costs (the policy's occasional depth-1 probes remain); /metrics renders its gauges
(metrics.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

from ..results import acceptance_rates, count_draft

log = logging.getLogger("specloom.serve")

WINDOW = 512  # drafted steps (row-steps with a draft) in the rolling window
FRACTION = 0.5  # low: rolling alpha below this fraction of the start-up alpha ...
Z = 3.0  # ... by more than this many binomial standard errors at the start-up alpha
MIN_STEPS = 128  # drafted steps in the window before any judgement
CHECK_EVERY = 64  # drafted steps between judgements
CONSECUTIVE = 3  # low (or not low) judgements in a row that set (or clear) `degraded`
WARN_INTERVAL_S = 300.0  # at most one warning per this many seconds


class AcceptanceMonitor:
    def __init__(self, expected_tau: float | None = None, depth: int = 0, source: str = "the drafter's manifest",
                 window: int = WINDOW, fraction: float = FRACTION, z: float = Z, min_steps: int = MIN_STEPS,
                 check_every: int = CHECK_EVERY, consecutive: int = CONSECUTIVE,
                 warn_interval_s: float = WARN_INTERVAL_S, clock=time.monotonic):
        from ..depth import tau_to_alpha

        self.expected_tau = float(expected_tau) if expected_tau else None
        self.depth = depth
        self.expected_alpha = (tau_to_alpha(self.expected_tau, depth) if self.expected_tau and depth > 0
                               else None)
        self.source = source  # where the start-up figure came from, for the warning
        self.window, self.fraction, self.z = window, fraction, z
        self.min_steps, self.check_every, self.consecutive = max(1, min_steps), max(1, check_every), consecutive
        self.warn_interval_s, self.clock = warn_interval_s, clock
        self.lock = threading.Lock()
        self.steps: deque[tuple[int, int]] = deque()  # (depth, accepted) of the last `window` drafted steps
        self.accepted = 0  # accepted draft tokens in the window
        self.examined = 0  # draft positions the verifier examined in the window
        self.proposed_at: list[int] = []  # drafts in the window that reached position i
        self.accepted_at: list[int] = []  # ... whose token at position i was accepted
        self.total_steps = 0  # drafted steps ever observed
        self._since_check = 0
        self.low_streak = self.ok_streak = 0
        self.degraded = False
        self.warnings = 0  # warnings logged
        self._last_warn: float | None = None
        self.action = ""  # what the server does about it, for the warning (set by the scheduler)

    # -- feeding ---------------------------------------------------------------------------------------------
    def observe(self, trees, accepted) -> None:
        """One scheduler step: each row's verified draft tree (StepReport.trees) and its accepted count; rows
        without a draft (a one-node tree) are not drafted steps."""
        self.observe_counts([(tree.max_depth if len(tree) > 1 else 0, a) for tree, a in zip(trees, accepted)])

    def observe_counts(self, steps) -> None:
        """Drafted steps as (depth, accepted) pairs (depth 0: no draft, skipped)."""
        with self.lock:
            for d, a in steps:
                if d <= 0:
                    continue
                self._add(int(d), max(0, min(int(a), int(d))))
                if self._since_check >= self.check_every and len(self.steps) >= self.min_steps:
                    self._since_check = 0
                    self._judge()

    def _add(self, d: int, a: int) -> None:
        self.steps.append((d, a))
        self.accepted += a
        self.examined += a + (1 if a < d else 0)
        count_draft(self.proposed_at, self.accepted_at, d, a)
        if len(self.steps) > self.window:
            od, oa = self.steps.popleft()
            self.accepted -= oa
            self.examined -= oa + (1 if oa < od else 0)
            count_draft(self.proposed_at, self.accepted_at, od, oa, n=-1)
        self.total_steps += 1
        self._since_check += 1

    # -- figures ---------------------------------------------------------------------------------------------
    @property
    def alpha(self) -> float | None:
        """Rolling acceptance rate (accepted / examined draft positions) over the window; None before any."""
        return self.accepted / self.examined if self.examined else None

    @property
    def per_position(self) -> list[float]:
        """Rolling acceptance per draft position (0-based) over the window."""
        # proposed_at never grows with i (a draft reaching i reached every position before it): zeros trail
        return acceptance_rates(self.accepted_at, self.proposed_at, reached_only=True)

    @property
    def tau(self) -> float | None:
        """Rolling tokens per drafted step (1 + accepted per drafted step): depends on the chosen depths."""
        return 1 + self.accepted / len(self.steps) if self.steps else None

    def is_low(self) -> bool:
        """Whether the window's acceptance is below `fraction` x the start-up figure, and significantly so."""
        e, a, n = self.expected_alpha, self.alpha, self.examined
        if e is None or e <= 0 or a is None or n <= 0:
            return False
        se = math.sqrt(e * (1 - e) / n)
        return a < self.fraction * e and e - a > self.z * se

    def snapshot(self) -> dict:
        with self.lock:
            return {"acceptance_rate": self.alpha, "per_position": self.per_position, "tau": self.tau,
                    "expected_tau": self.expected_tau, "expected_acceptance_rate": self.expected_alpha,
                    "degraded": self.degraded, "window_steps": len(self.steps), "total_steps": self.total_steps,
                    "warnings": self.warnings}

    # -- judging ---------------------------------------------------------------------------------------------
    def _judge(self) -> None:
        """One judgement (under the lock): update the streaks, flip `degraded`, warn."""
        if self.is_low():
            self.low_streak, self.ok_streak = self.low_streak + 1, 0
        else:
            self.low_streak, self.ok_streak = 0, self.ok_streak + 1
        now = self.clock()
        if not self.degraded and self.low_streak >= self.consecutive:
            self.degraded = True
            self._warn(now)
            return
        if self.degraded and self.ok_streak >= self.consecutive:
            self.degraded = False
            log.info("speculative acceptance recovered: %.3f over the last %d drafted steps (start-up figure %.3f)",
                     self.alpha, len(self.steps), self.expected_alpha)
            return
        if self.degraded:
            self._warn(now)  # a reminder while it lasts, rate-limited

    def _warn(self, now: float) -> None:
        if self._last_warn is not None and now - self._last_warn < self.warn_interval_s:
            return
        self._last_warn = now
        self.warnings += 1
        per = ", ".join(f"{x:.2f}" for x in self.per_position)
        log.warning(
            "speculative acceptance has dropped: %.3f over the last %d drafted steps (per position %s) is below "
            "%.2f x the start-up figure %.3f (tau %.2f at depth %d, from %s) for %d checks in a row; the drafter "
            "may not match this target (another quantization, a fine-tune) or this workload.%s (at most one such "
            "warning per %.0f s)",
            self.alpha, len(self.steps), per or "-", self.fraction, self.expected_alpha, self.expected_tau,
            self.depth, self.source, self.low_streak, self.action and " " + self.action, self.warn_interval_s)


def attach_monitor(scheduler, expected_tau: float | None = None, **settings) -> AcceptanceMonitor:
    """Give `scheduler` (scheduler.py) a live acceptance monitor: rolling acceptance against `expected_tau` (the
    start-up check's figure, e.g. `specloom doctor`'s probe) or the drafter manifest's; `settings` go to
    AcceptanceMonitor (window, min_steps, ...). Returns the monitor."""
    mon = AcceptanceMonitor(expected_tau or scheduler.prior_tau, scheduler.policy.max_k,
                            "the start-up check" if expected_tau else "the drafter's manifest", **settings)
    if scheduler.policy.mode == "load_aware":
        mon.action = ("Load-aware speculation now judges new requests by the measured acceptance "
                      "instead of the start-up figure, so drafting turns down where it does not pay.")
    scheduler.monitor = mon
    return mon
