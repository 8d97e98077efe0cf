"""How deep to draft this step (load-aware speculation), from the batch size and each request's recent acceptance.

A verification pass over n rows of T tokens costs c(n, T) (relative to one plain single-sequence decode step:
cost.py measures, caches and calibrates it). Drafting costs d per depth per request (measured online). A request
with per-token acceptance alpha emits on average
E(alpha, k) = 1 + alpha + ... + alpha^k tokens from a k-deep chain. Each step the policy picks the depth k that
maximises the batch's expected tokens per unit time

    sum_r E(alpha_r, k) / (c(n, 1 + nodes(k)) + n * k * d)

(k = 0 is plain decoding: speculation switches itself off when the machine is busy), then lowers k for each
request whose own acceptance does not pay for its share. Acceptance per request is a decayed count of accepted
drafts and rejections (the maximum-likelihood alpha of a geometric run), started from the running average of all
requests, which starts from the drafter's measured tau (its checkpoint's manifest figure) or 0.5. Modes: "off"
(never draft), "fixed" (always the configured depth), "load_aware" (this policy; `generate`/`bench` call it
"auto" and run it over one row: `Engine(speculation="auto")`).

The same mechanism on every host: where verification is nearly free (oneDNN bf16: c(1, 9) ~ 1.2) it drafts deep;
where a pass costs about its token count (AVX2-only bf16: c(1, 5) ~ 3.3) no depth pays and it decodes plain. The
curve is measured per host and linear kernel (host/). One copy for `Engine.generate` and the scheduler.
Each step reads the same three lines wherever it runs (`Engine.generate`, the scheduler):

    plan = policy.plan(stepper, rows)     # advice: a value (depth and tree size per row, probes, free drafts)
    report = stepper.step(rows, plan)     # the step acts on it
    policy.observe(rows, plan, report)    # the policy learns (cost curve, acceptance, drafting cost)

Imports: cost.py and step.py's StepPlan (the drafter, stepper and rows it is handed are duck-typed).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from dataclasses import dataclass, field

from .cost import BatchCost
from .errors import SpecloomError
from .step import StepPlan

MODES = ("off", "fixed", "load_aware")
PROBE_NEVER = 2 ** 31  # a row's probe period when it is not to be probed (`DepthPolicy.admit`)
MODE_ALIASES = {"auto": "load_aware"}  # what generate / bench call it


@dataclass
class PolicyPlan(StepPlan):
    """A step's plan with what the policy needs to learn from the step it leads to."""

    alphas: list[float] = field(default_factory=list)  # each row's acceptance as judged when planning
    free: set[int] = field(default_factory=set)  # rows verifying a free draft (no drafter pass)
    probed: set[int] = field(default_factory=set)  # idle rows probed at depth 1
    backlog: bool = False  # some drafted row first catches up this step (its cost is not steady drafting)
    width: int = 1  # the pass width the policy priced this step at (a row's tree may come out wider)


def speculation_mode(name: str) -> str:
    """The policy mode a `speculation` setting names ("auto" is "load_aware"); one clear error otherwise."""
    mode = MODE_ALIASES.get(name, name)
    if mode not in MODES:
        raise SpecloomError(f"speculation must be auto (load_aware), fixed or off, got {name!r}")
    return mode

log = logging.getLogger("specloom")


def geometric_tokens(alpha: float, k: int) -> float:
    """Expected tokens from one step with a k-deep chain whose drafts are each accepted with probability alpha:
    1 + alpha + ... + alpha^k (summed in closed form; the policy asks it many times a step)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Acceptance:
    """Decayed counts of accepted drafts and of steps that ended in a rejection: alpha = a / (a + r)."""

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.8, period: int = 8):
        self.a, self.r, self.decay = prior * weight, (1 - prior) * weight, decay
        self.n = 0  # drafted steps observed
        self.seen_a = self.seen_r = 0  # undecayed counts of this row's own drafts (no prior): the evidence
        self.idle = 0  # steps since this row last drafted (the policy's probe clock) ...
        self.period = period  # ... and the idle steps after which it is probed (DepthPolicy.explore_base, doubling)
        self.caught_up = False  # drafted at its previous step: its drafter has no backlog to catch up on

    def update(self, proposed_depth: int, accepted: int) -> None:
        if proposed_depth <= 0:
            return
        self.n += 1
        rejected = 1 if accepted < proposed_depth else 0
        self.a = self.a * self.decay + accepted
        self.r = self.r * self.decay + rejected
        self.seen_a += accepted
        self.seen_r += rejected

    def upper(self, z: float = 1.28) -> float:
        """An upper confidence bound (Wilson, one-sided 90 % at z = 1.28) on this row's own acceptance from its
        undecayed counts alone: each drafted position up to the first rejection is one Bernoulli trial. 1.0
        before any evidence."""
        n = self.seen_a + self.seen_r
        if n == 0:
            return 1.0
        p, z2 = self.seen_a / n, z * z
        return min(1.0, (p + z2 / (2 * n) + z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (1 + z2 / n))

    @property
    def alpha(self) -> float:
        return self.a / (self.a + self.r) if self.a + self.r > 0 else 0.0


def tau_to_alpha(tau: float, k: int) -> float:
    """The per-depth acceptance alpha whose k-deep geometric run gives tau tokens per step (inverse of
    `geometric_tokens`): how a drafter's measured tau becomes the policy's prior."""
    if k <= 0 or tau <= 1.0:
        return 0.0
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if geometric_tokens(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def cheap_drafter(drafter) -> bool:
    """A drafter that reads no target features and keeps no KV of its own (n-gram, suffix): it catches up from
    the tokens alone and a probe costs it nothing but the verification, so it stays on (probed now and then)
    even where no acceptance could pay. Other drafters whose idle steps are free (`Drafter.idle_free`: EAGLE,
    MTP, Medusa, draft model, DFlash, DSpark) are probed too, but only where some acceptance would pay."""
    try:
        kv = drafter.memory().get("kv_per_1k_tokens", 0)
    except Exception:
        kv = 1
    return not drafter.needs_hidden and not kv


class DepthPolicy:
    """How deep each row drafts this step; one copy for `Engine.generate` (one row, `speculation="auto"`) and
    the serving scheduler (`--speculation load_aware`).

    `plan(stepper, rows, caps)` then `observe(rows, plan, report)` is the whole mechanism: choose a depth per row,
    size trees to it (a shallower EAGLE-2/MTP tree keeps proportionally fewer nodes); after the step, calibrate the
    cost curve with the measured pass, update each row's acceptance and the drafting cost. In "load_aware" mode a
    row whose drafter cannot pay even alone falls back to plain decoding. A drafter whose idle steps are free
    (`idle_free`: its state catches up lazily when it next drafts, as every built-in kind's does) stays on and is
    probed at depth 1 every `explore_base` idle steps (doubling while probes do not pay, up to `explore_max`: both
    8, since a cap of 64 left rows idle for long stretches of drafts that would have paid), so a row whose text
    becomes predictable drafts again; a cheap one (n-gram, suffix: no features, no KV) always, any other only where
    some acceptance (alpha 1) would pay on this curve -- where none could, probing is waste and it is turned off. A
    drafter whose state needs per-step work (`idle_free` False) is turned off for the row after `patience` idle
    steps (or at admission, `admit`, when its prior already says it cannot pay). Rows left idle may still verify a
    draft that costs no drafter pass (`Drafter.free_drafts`: the suffix half of a hybrid) where its expected tokens
    pay for the wider pass. Evidence only drafted steps renew (drafting's cost, `optimism`) is forgotten after
    `forget_after` steps without one, so a busy stretch cannot turn drafting off for good (`forget`). Where the
    drafter's passes have cost more than they returned (`value`, in plain steps), only every `explore_every`-th
    new row is probed: a request's first probe catches the drafter up over its whole prompt."""

    def __init__(self, mode: str, max_k: int, cost: BatchCost | None = None, prior_alpha: float = 0.5,
                 nodes_per_depth: float = 1.0, full_nodes: int | None = None, cheap: bool = False,
                 calibrate: bool = True, idle_free: bool | None = None):
        mode = speculation_mode(mode)
        if mode == "load_aware" and cost is None:
            raise ValueError("load-aware speculation needs a batch cost curve")
        self.mode, self.max_k, self.cost = mode, max_k, cost
        self.draft_cost = 0.0  # drafting time per depth per request, relative to c(1, 1) (see `observe`)
        self._draft_obs: deque = deque(maxlen=17)
        self.calibrate = calibrate  # scale the cost curve's points with measured passes (serving)
        self.nodes_per_depth = nodes_per_depth  # tree nodes per unit of depth (1 for chains; EMA over trees)
        self.full_nodes = full_nodes  # the drafter's own tree size at max_k (None: a chain)
        self.cheap = cheap
        self.idle_free = cheap if idle_free is None else idle_free  # idle steps cost it nothing (probe, not off)
        self.prior_alpha = prior_alpha
        self.global_alpha = Acceptance(prior=prior_alpha, weight=2.0, decay=0.98)
        self.explore_base, self.explore_max, self.patience = 8, 8, 8
        # a row's first `trial` drafted steps judge it at no less than the drafter's prior -- or than what its
        # own drafts still allow, if lower (`alpha`): two unlucky first steps (alpha 0.5 -> 0.2) would otherwise
        # stop a drafter that pays for the whole request, and a stopped row never drafts again to correct it
        # (nor, through the running average, the next rows); a row whose drafts are rejected step after step
        # (a writing prompt for a code draft model) stops within a few steps instead of paying for all eight
        self.trial = 8
        self.margin = 1.02  # a depth must beat plain decoding by 2 % to be chosen ...
        # ... times how much the policy's own predictions of drafted steps have run high (`optimism`): decayed sums
        # of expected and emitted tokens and of predicted and measured step cost, drafted steps against plain ones
        self._drafted = [0.0, 0.0, 0.0, 0.0]  # expected tokens, emitted tokens, predicted cost, measured cost
        self._plain = [0.0, 0.0]  # predicted cost, measured cost
        # evidence against drafting (its cost, the predictions' shortfall) is renewed only by drafted steps, which
        # it may itself prevent: after this many steps without a measured drafted step it is forgotten (`forget`)
        self.forget_after = 512
        # what the drafter's passes returned, in plain steps: tokens emitted less the pass and drafting they cost,
        # decayed over the steps it ran (probes and catch-ups included, free drafts not); below zero, a new row
        # is not probed (`admit`), but every `explore_every`-th such row still is, to keep learning
        self.value, self.explore_every, self._gated = 0.0, 4, 0
        self._quiet = 0  # steps since the last drafted step that measured drafting (no catch-up in it)
        # a row's acceptance: its drafted steps decayed by `acc_decay` per step (0.8 once: ~5 steps, a noisy
        # figure that a few rejections took below break-even), and after its trial never judged below the upper
        # bound (z = `lifetime_z`) of all its own drafts (`Acceptance.upper`): a row idles once its drafts as a
        # whole rule drafting out, not on a streak. An idle row learns nothing, so the few rejections of a
        # drafter that paid on average (EAGLE-3 at depth 1: ~0.39 accepted, break-even ~0.28 here) once made
        # `auto` 7-9 % slower than drafting every step
        self.acc_decay, self.lifetime_z = 0.95, 1.0
        self.last_k = 0
        self.last_free_width = 1  # the pass width `_free_drafts` priced its taken drafts at

    @classmethod
    def for_drafter(cls, mode: str, drafter, cost: BatchCost | None = None,
                    prior_tau: float | None = None, calibrate: bool = True) -> "DepthPolicy":
        """A policy for `drafter` (None: off): its depth, tree size per depth, cheapness and a prior acceptance
        from its measured tau (0.5 when unknown). Load-aware, with a host curve `cost`, a drafter that can
        (`fit_tree`: EAGLE's shape table) first re-chooses its tree for that curve (fixed speculation keeps it).
        `calibrate` False keeps the cost curve's shape as measured (Engine.generate: on a shared host, transient
        slow passes would otherwise tilt it for the rest of a run)."""
        fit = getattr(drafter, "fit_tree", None)
        if mode == "load_aware" and cost is not None and fit is not None and fit(cost):  # once, for this host
            prior_tau = getattr(drafter, "prior_tau", None) or prior_tau
        k = drafter.num_speculative_tokens if drafter is not None else 0
        if not k:
            return cls("off", 0)
        nodes = drafter.num_nodes
        prior = tau_to_alpha(prior_tau, k) if prior_tau else 0.5
        cheap = cheap_drafter(drafter)
        return cls(mode, k, cost, prior_alpha=prior, nodes_per_depth=nodes / k if nodes else 1.0,
                   full_nodes=nodes, cheap=cheap, calibrate=calibrate,
                   idle_free=bool(getattr(drafter, "idle_free", cheap)))

    def new_acceptance(self) -> Acceptance:
        return Acceptance(prior=self.global_alpha.alpha, weight=2.0, period=self.explore_base, decay=self.acc_decay)

    def admit(self, row, drafter) -> None:
        """Give a new row its acceptance counters; in load-aware mode turn a drafter that would not be probed
        (`probes`) off before its prefill when even alone it could not pay at the drafter's prior acceptance (nor
        at what recent requests saw): e.g. a tree drafter whose tree costs 5 decode steps to verify, where not
        even perfect drafts would pay. One that would be probed stays on and starts idle."""
        row.acc = self.new_acceptance()
        alpha = max(self.prior_alpha, self.global_alpha.alpha)
        cap = row.cap(drafter)
        if (self.mode == "load_aware" and row.drafting and not self.probes(cap)
                and not self.pays_alone(alpha, cap)):
            row.stop_drafting()
        elif self.mode == "load_aware" and not self.cheap and self.value < 0:
            self._gated += 1
            if self._gated % self.explore_every:  # drafting has cost more than it returned: no probes this row
                row.acc.period = PROBE_NEVER

    def probes(self, cap: int) -> bool:
        """Whether a row that cannot pay now stays on and is probed (else it is turned off): its drafter's idle
        steps are free, and it is cheap or some acceptance would pay (a probe could find it)."""
        return self.idle_free and (self.cheap or self.pays_alone(1.0, cap))

    def _learn(self, acc: Acceptance, depth: int, nodes: int, accepted: int, draft_seconds: float,
               step_seconds_1x1: float | None) -> None:
        if depth <= 0:
            return
        acc.update(depth, accepted)
        self.global_alpha.update(depth, accepted)
        self.nodes_per_depth = 0.9 * self.nodes_per_depth + 0.1 * (nodes - 1) / depth
        if step_seconds_1x1:
            # the median of the last 16 drafted steps (the very first, a warm-up with lazy allocations and new
            # shapes, is not counted): a few steps slowed by other work on a shared host do not turn drafting off
            obs = self._draft_obs
            obs.append(draft_seconds / depth / step_seconds_1x1)
            if len(obs) > 1:
                self.draft_cost = statistics.median(list(obs)[1:] if len(obs) < obs.maxlen else obs)

    def nodes(self, k: int) -> int:
        """Tokens of a k-deep draft's verification pass (root included)."""
        return 1 + math.ceil(k * self.nodes_per_depth)

    def _rate(self, alphas: list[float], k: int, n: int) -> float:
        return sum(geometric_tokens(a, k) for a in alphas) / (self.cost(n, self.nodes(k)) + n * k * self.draft_cost)

    def expected_speedup(self, alpha: float, k: int) -> float:
        """One row: E[tokens per step](k) / (verify_cost(k) + draft_cost(k)) against plain decoding."""
        return self._rate([alpha], k, 1) / self._rate([alpha], 0, 1)

    def pays_alone(self, alpha: float, cap: int) -> bool:
        """Whether some depth up to `cap` beats plain decoding (by the margin) for one row at this acceptance."""
        if self.cost is None:
            return cap > 0
        return any(self.expected_speedup(alpha, k) > self.need() for k in range(1, min(self.max_k, cap) + 1))

    def choose(self, alphas: list[float], caps: list[int]) -> list[int]:
        """Depth per request (each at most its cap: the drafter's depth and the tokens it may still emit)."""
        if self.mode == "off" or not alphas:
            ks = [0] * len(alphas)
        elif self.mode == "fixed":
            ks = [min(self.max_k, c) for c in caps]
        else:
            n = len(alphas)
            top = min(self.max_k, max(caps))
            need = self.need()
            rates = [self._rate(alphas, k, n) for k in range(top + 1)]
            base = rates[0] * need
            k_batch = max(range(top + 1), key=lambda k: (rates[k] if k == 0 or rates[k] > base else 0.0, -k))
            ks = []
            for a, c in zip(alphas, caps):
                share = [geometric_tokens(a, k) / (self.cost(n, self.nodes(k)) / n + k * self.draft_cost)
                         for k in range(min(k_batch, c) + 1)]
                ks.append(max(range(len(share)), key=lambda k: (share[k] if k == 0 or share[k] > share[0] * need
                                                                else 0.0, -k)))
            if not self.batch_pays(alphas, ks):
                ks = [0] * n
        self.last_k = max(ks, default=0)
        return ks

    def optimism(self) -> float:
        """How far drafted steps have fallen short of what the policy expected of them, relative to plain steps:
        (expected / emitted tokens) x (measured cost of drafted steps / their cost at the width the plan priced)
        / (the same cost ratio of plain steps), over decayed recent steps; 1 until there is evidence, never below
        1, at most 1.5. It covers what the model gets wrong: attention that grows with longer contexts than the
        curve's, acceptance judged at a prior during a row's trial, trees priced as chains, and a hybrid's
        depth-1 steps that verify its suffix tree whole: 2.1 tokens where 1.6 were expected, for a pass up to 9
        tokens wide where 2 were priced: judged at the realized width, its tokens counted while its pass hid
        its cost. (Crediting such a surplus in the expected tokens as well ran slower on two held-out Spec-Bench
        slices: 1.375x / 1.319x against 1.429x / 1.333x; BENCHMARKS.md, seventeenth session.) (A step in which a
        drafter catches up is left out.)"""
        exp, got, pred, meas = self._drafted
        p_pred, p_meas = self._plain
        if got < 16 or pred <= 0 or meas <= 0:
            return 1.0
        plain = p_meas / p_pred if p_pred > 0 and p_meas > 0 else 1.0
        return min(max(exp / got * meas / pred / plain, 1.0), 1.5)

    def need(self) -> float:
        """The factor by which a depth must beat plain decoding to be chosen."""
        return self.margin * self.optimism()

    def _account(self, expected: float, emitted: int, predicted: float, measured: float, drafted: bool,
                 decay: float = 0.97) -> None:
        if drafted:
            for i, v in enumerate((expected, emitted, predicted, measured)):
                self._drafted[i] = self._drafted[i] * decay + v
        else:
            self._plain = [self._plain[0] * decay + predicted, self._plain[1] * decay + measured]

    def batch_pays(self, alphas: list[float], ks: list[int]) -> bool:
        """Whether these per-row depths pay for the pass they make: every row is padded to the widest draft, so
        two rows drafting one deep in a pass of sixteen widen all sixteen (a share per row does not see that)."""
        n = len(ks)
        if not any(ks):
            return True
        tokens = sum(geometric_tokens(a, k) for a, k in zip(alphas, ks))
        cost = self.cost(n, max(self.nodes(k) for k in ks)) + sum(ks) * self.draft_cost
        return tokens / cost > self.need() * n / self.cost(n, 1)

    def alpha(self, acc: Acceptance) -> float:
        """A row's acceptance as the policy judges it: its own, during its trial steps floored at the prior or at
        the upper confidence bound of its own drafts (`Acceptance.upper`), whichever is lower: the floor keeps
        a drafter that pays through an unlucky start, the bound ends the trial early for one the evidence
        already rules out (0 of 3 drafts accepted: at most 0.35)."""
        if acc.n >= self.trial:
            return max(acc.alpha, acc.upper(self.lifetime_z)) if self.lifetime_z else acc.alpha
        return max(acc.alpha, min(self.prior_alpha, acc.upper()))


    def plan(self, stepper, rows: list, caps: list[int] | None = None) -> "PolicyPlan":
        """The depths this policy advises for one step of `rows` (any pool rows): a depth per row, trees sized
        to it (a shallower EAGLE-2/MTP tree keeps proportionally fewer nodes), probes of idle rows, free drafts
        worth verifying. `caps`: each row's deepest draft (default: its own cap). Nothing is written into the
        rows' draft contexts: the step acts on the plan (`Stepper.step(rows, plan)`), then `observe`."""
        drafter = stepper.drafter
        if caps is None:
            caps = [r.cap(drafter) for r in rows]
        alphas = [self.alpha(r.acc) for r in rows]
        ks = self.choose(alphas, caps)
        probed = set()
        if self.mode == "load_aware":
            for i, (r, k, c) in enumerate(zip(rows, ks, caps)):
                if k > 0 or c <= 0 or not r.drafting:
                    r.acc.idle, r.acc.period = 0, self.explore_base if k > 0 else r.acc.period
                    continue
                r.acc.idle += 1
                if self.pays_alone(alphas[i], c):
                    continue  # idle because of the load, not the drafter
                if not self.probes(c):
                    if r.acc.idle >= self.patience:  # it cannot pay: stop its per-step updates too
                        r.stop_drafting()
                elif r.acc.idle >= r.acc.period:  # probe: a depth-1 step refreshes this row's acceptance (the
                    ks[i] = 1  # drafter first catches up over the idle positions: one pass over them)
                    probed.add(i)
        free = self._free_drafts(stepper, rows, ks, caps) if self.mode == "load_aware" else set()
        full = self.max_k
        shrink = self.mode == "load_aware" and self.full_nodes  # not for the budget's own cut
        nodes = [max(k, -(-self.full_nodes * k // full)) if shrink and 0 < k < full and i not in free else None
                 for i, k in enumerate(ks)]
        # a step in which some row's drafter first catches up (over the prompt at the row's first drafted step,
        # over the positions it sat idle after a pause) prices that catch-up as drafting: a 0.5B draft model's
        # prompt prefill read as 2.0 target steps per depth where steady drafting costs 0.48, and one such step
        # in the median of a few turned a paying drafter off. Only steps without a backlog measure the cost.
        # (a free draft runs no drafter pass: its row's backlog stays for the next drafted step)
        drafted = [k > 0 and i not in free for i, k in enumerate(ks)]
        backlog = any(d and not r.acc.caught_up for r, d in zip(rows, drafted))
        for r, d in zip(rows, drafted):
            r.acc.caught_up = d
        width = max([self.nodes(k) for i, k in enumerate(ks) if k > 0 and i not in free]
                    + [self.last_free_width if free else 1])
        return PolicyPlan(ks, nodes, alphas, free, probed, backlog, width)

    def observe(self, rows: list, plan: "PolicyPlan", rep) -> None:
        """Learn from the step `plan` led to (`rep`, a StepReport): calibrate the cost curve with the measured
        pass, check the policy's own predictions (`optimism`), update each row's acceptance and the drafting
        cost."""
        n, ks, free = len(rows), plan.depths, plan.free
        drafted = [i for i, k in enumerate(ks) if k > 0 and i not in free and i not in rep.forced]  # drafter ran
        unit = self.cost.base if self.cost is not None else None  # seconds of one 1x1 pass (the curve's unit; a
        # curve refreshed in idle time, cost_refresh.py, brings its own)
        if self.cost is not None and self.mode == "load_aware":
            if not self.calibrate and not self.cost.frozen and rep.pass_seconds > 0:
                # an uncalibrated measured curve: drafting time in units of this very step's pass (seconds of
                # c = 1 now), since both slow down alike when the host is busy; a calibrated curve (serving)
                # follows the machine itself, a frozen (forced) one defines its own unit
                unit = rep.pass_seconds / self.cost(n, rep.width)
            if unit and rep.pass_seconds > 0 and not plan.backlog:  # before calibration: what the curve predicted
                # (a step in which a drafter catches up is left out, as from the drafting cost: a one-off per pause)
                # priced at the width the plan assumed: a hybrid's depth-1 step that verifies its suffix tree
                # 8 deep runs a 9-token pass (in a batch, every row's) and emits more than a depth-1 chain; the
                # two surprises are weighed together (`optimism`)
                predicted = self.cost(n, max(plan.width, 1)) + sum(ks[i] for i in drafted) * self.draft_cost
                measured = (rep.pass_seconds + rep.draft_seconds) / unit
                if self.cost.frozen:  # a forced curve defines its own unit: only its tokens can be checked
                    predicted = measured = 1.0
                self._account(sum(geometric_tokens(a, k) for a, k in zip(plan.alphas, ks)),
                              sum(1 + a for a in rep.accepted), predicted, measured, drafted=rep.width > 1)
            if drafted and unit and rep.pass_seconds > 0:  # before calibration, in this step's own unit
                spent = (rep.pass_seconds + rep.draft_seconds) / unit / self.cost(n, 1)
                self.value = self.value * 0.98 + sum(1 + a for a in rep.accepted) / n - spent
            if self.calibrate:
                self.cost.observe(n, rep.width, rep.pass_seconds)
        for i, (r, tree, acc) in enumerate(zip(rows, rep.trees, rep.accepted)):
            if i in rep.forced:  # the grammar's forced tokens, not the drafter's: nothing to learn about it
                continue
            if i in free:  # the row's acceptance only: a free draft says nothing of drafting cost or tree size
                r.acc.update(tree.max_depth, acc)
                continue
            self._learn(r.acc, tree.max_depth, len(tree), acc, rep.draft_seconds / n, None if plan.backlog else unit)
            if i in plan.probed and tree.max_depth > 0:  # a probe that drew a draft (n-gram: a match) counts;
                r.acc.idle = 0  # one without keeps probing at the next step (it cost no verification)
                r.acc.period = min(2 * r.acc.period, self.explore_max)
        if self.mode == "load_aware":
            self._quiet = 0 if drafted and not plan.backlog else self._quiet + 1
            if self._quiet >= self.forget_after:
                self.forget()

    def forget(self) -> None:
        """Start over on drafting's cost and on the policy's own predictions (`optimism`), as a new engine would.
        Both are renewed only by drafted steps, so evidence that stops drafting would otherwise stand for the
        engine's life: a stretch measured while other work loaded the host (EAGLE-3 drafting at 0.45 of a decode
        step per depth, its predictions 1.5x too optimistic) turned the README default to plain decoding for
        every later request (tau 1.00 on 25 prompts in a row). Relearning costs the next few drafted steps."""
        self._draft_obs.clear()
        self.draft_cost = 0.0
        self._drafted = [0.0, 0.0, 0.0, 0.0]
        self._plain = [0.0, 0.0]
        self._quiet = 0  # (`value` stays: every `explore_every`-th row is probed, which renews it)

    def _free_drafts(self, stepper, rows: list, ks: list[int], caps: list[int]) -> set[int]:
        """Rows left idle this step (depth 0, drafting, a cap) whose free draft (`Drafter.free_drafts`: no
        drafter pass) is worth verifying: offers best first, each taken while the batch's expected tokens per
        unit of pass time, (tokens + e) / c(n, width), beat those without it by the margin (the width is the
        widest tree of the step). A taken row runs at its tree's depth; returns their indices."""
        idle = [i for i, (r, k, c) in enumerate(zip(rows, ks, caps)) if k == 0 and c > 0 and r.drafting]
        if stepper.drafter is None or not idle or \
                not getattr(stepper, "offers_free_drafts", hasattr(stepper, "free_drafts")):
            return set()
        try:
            offers = stepper.free_drafts([rows[i] for i in idle], [caps[i] for i in idle])
        except Exception:  # a free draft is an extra: without one the step runs as chosen
            log.exception("drafter free_drafts failed: none this step")
            return set()
        n = len(rows)
        tokens = sum(geometric_tokens(self.alpha(r.acc), k) for r, k in zip(rows, ks))
        width = max(self.nodes(k) if k else 1 for k in ks)
        taken = set()
        self.last_free_width = width
        for i, (tree, e) in sorted(((i, o) for i, o in zip(idle, offers) if o is not None), key=lambda x: -x[1][1]):
            w = max(width, len(tree))
            if (tokens + e) / self.cost(n, w) > self.need() * tokens / self.cost(n, width):
                tokens, width = tokens + e, w
                ks[i] = max(1, min(tree.max_depth, caps[i]))
                taken.add(i)
                self.last_free_width = width
        return taken
