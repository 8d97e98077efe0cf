"""Suffix decoding in front of a model drafter (`"suffix_decoding": true` beside any method; the hybrid of
SuffixDecoding's paper and Arctic Inference, where suffix decoding backs a model speculator).

The two drafters are good at different text: suffix decoding wins where the answer repeats its context
(extraction, translation, RAG, summarisation: long exact matches, deep cheap drafts), a trained drafter where it
does not (code, maths, reasoning). Each step a row first drafts from its suffix tries, which costs microseconds;
where that tree's score (its expected accepted tokens under the tries' counts, `DraftTree.score`) reaches
`suffix_decoding_min_score`, that tree is verified, and elsewhere the model drafter drafts as it would alone.
Both keep their per-row state every step: the model drafter sees every verified step (its catch-up feeds it the
positions a suffix tree won), the suffix tries see every token. Verification is unchanged, so the output stays
the target's own.

To the depth policy the pair is the model drafter: its depth and tree size. The suffix side drafts up to its
own `num_speculative_tokens` (8 unless a `suffix_decoding_*` key says otherwise) when the policy asks for the
model drafter's full depth, proportionally fewer when it asks for less, and never past the row's token budget.
Its tree has at most as many nodes as its depth, so for a tree drafter it is never the costlier pass to verify.

Which tree: the suffix tree when its *calibrated* score reaches what the model drafter delivers. The tries'
counts are overconfident on text seen once (one earlier occurrence scores every node 1.0), so each row keeps
decayed sums of the tokens its suffix trees got accepted and of the scores they claimed, and scales the score by
their ratio; and it keeps a decayed mean of the tokens the model drafter's trees got accepted. Both start from
drafter-wide figures (learned over all rows), which start from 1.0 and from the model drafter's measured τ − 1
(its checkpoint's figure; 1.0 when unknown). `suffix_decoding_min_score` fixes the threshold instead of the
model drafter's running mean (the calibration still applies).

Where the load-aware policy leaves a row idle (the pair cannot pay at its acceptance, or the batch is busy), the
model half drafts nothing, but the suffix half still costs nothing to ask: `free_drafts` offers the row's suffix
tree with its calibrated score, and the policy verifies it where those expected tokens pay for the wider pass
(its outcome feeds the row's acceptance, so predictable text brings the pair back to drafting). The pair is as
`idle_free` as its model half (every built-in kind is): the row stays on and the model half is probed now and
then, catching up over the idle positions when it next drafts.
"""

from __future__ import annotations

import dataclasses
import math

from ..base import DraftContext, Drafter, float_key
from .drafter import SuffixDrafter

KEYS = {"suffix_decoding_min_score": float_key(0, 256)}  # beside the suffix kind's own suffix_decoding_* keys


class Tally:
    """Decayed sums: accepted tokens and claimed scores of suffix trees, accepted tokens of model trees."""

    __slots__ = ("s_acc", "s_score", "m_acc", "m_n")

    def __init__(self, calib: float, model_mean: float, weight: float = 2.0):
        self.s_acc, self.s_score = calib * weight, weight
        self.m_acc, self.m_n = model_mean * weight, weight

    @property
    def calibration(self) -> float:
        return self.s_acc / self.s_score

    @property
    def model_mean(self) -> float:
        return self.m_acc / self.m_n

    def add(self, used_suffix: bool, score: float, accepted: int, decay: float) -> None:
        if used_suffix:
            self.s_acc, self.s_score = self.s_acc * decay + accepted, self.s_score * decay + max(score, 1e-3)
        else:
            self.m_acc, self.m_n = self.m_acc * decay + accepted, self.m_n * decay + 1.0


class HybridState:
    __slots__ = ("inner", "suffix", "tally", "last", "free")

    def __init__(self, inner, suffix, tally: Tally):
        self.inner, self.suffix, self.tally = inner, suffix, tally
        self.last = None  # (used the suffix tree, its score) of the step being verified
        self.free = None  # (root position, suffix tree) offered by `free_drafts` for this step


class SuffixFirst(Drafter):
    """`suffix` drafts first; rows whose suffix tree scores below `min_score` are drafted by `inner`."""

    def __init__(self, inner: Drafter, suffix: SuffixDrafter, min_score: float | None = None,
                 prior_tau: float | None = None):
        self.inner, self.suffix = inner, suffix
        self.method = f"{inner.method}+suffix"
        self.needs_hidden = inner.needs_hidden
        self.num_nodes = inner.num_nodes
        self.checkpoint = inner.checkpoint
        self.prior_tau = getattr(inner, "prior_tau", None) or prior_tau
        self.min_score = None if min_score is None else float(min_score)  # None: the model drafter's running mean
        model_mean = self.prior_tau - 1.0 if self.prior_tau and self.prior_tau > 1.0 else 1.0
        self.tally = Tally(1.0, model_mean)  # drafter-wide: where each new row's figures start
        self.suffix_steps = 0  # rows x steps verified with the suffix tree / with the model drafter's
        self.inner_steps = 0

    @classmethod
    def wrap(cls, inner: Drafter, spec, target_config=None) -> "SuffixFirst":
        from ...drafters.checkpoint import drafter_prior_tau

        prior = drafter_prior_tau(inner, spec, target_config)
        return cls(inner, SuffixDrafter.from_keys(spec, None), spec.suffix_decoding_min_score, prior)

    @property
    def num_speculative_tokens(self) -> int:
        return self.inner.num_speculative_tokens

    def fit_tree(self, curve) -> bool:
        """The model drafter's tree re-chosen for this host's curve (EAGLE's `fit_tree`); its prior follows."""
        fit = getattr(self.inner, "fit_tree", None)
        if fit is None or not fit(curve):
            return False
        self.num_nodes = self.inner.num_nodes
        tau = getattr(self.inner, "prior_tau", None)
        if tau:
            self.prior_tau = tau
            self.tally = Tally(1.0, tau - 1.0 if tau > 1.0 else 1.0)
        return True

    @property
    def idle_free(self) -> bool:
        return self.inner.idle_free  # the suffix tries catch up from the tokens (`SuffixDrafter._sync`)

    def memory(self) -> dict:
        return self.inner.memory()  # the tries live in host memory, outside the KV plan (see suffix/drafter.py)

    def new_state(self) -> HybridState:
        g = self.tally
        return HybridState(self.inner.new_state(), self.suffix.new_state(), Tally(g.calibration, g.model_mean))

    def threshold(self, tally: Tally) -> float:
        """The calibrated suffix score a row's suffix tree needs to be verified instead of the model's."""
        return tally.model_mean if self.min_score is None else self.min_score

    def takes_suffix(self, tree, tally: Tally) -> bool:
        return len(tree) > 1 and (tree.score or 0.0) * tally.calibration >= self.threshold(tally)

    # each inner drafter sees a context holding its own part of the state; what it leaves there is kept
    def _views(self, ctxs, part: str, **changes) -> list[DraftContext]:
        return [dataclasses.replace(c, state=getattr(c.state, part), **changes) for c in ctxs]

    @staticmethod
    def _keep(ctxs, views, part: str) -> None:
        for c, v in zip(ctxs, views):
            setattr(c.state, part, v.state)

    def prefill(self, ctx: DraftContext, target_out) -> None:
        (view,) = self._views([ctx], "inner")
        self.inner.prefill(view, target_out)
        self._keep([ctx], [view], "inner")

    def _suffix_depth(self, ctx: DraftContext) -> int:
        full = self.inner.num_speculative_tokens
        k = self.suffix.k if ctx.k >= full else math.ceil(self.suffix.k * ctx.k / full)
        return min(k, max(ctx.budget, ctx.k))

    def free_drafts(self, ctxs):
        """The suffix half costs no drafter pass: for rows whose model half idles, each row's suffix tree (as
        deep as `propose` would draw it at the row's cap) with its calibrated score as the expected accepted
        tokens; the depth policy decides whether verifying it pays (`suffix_decoding_min_score`, when set,
        still bars trees below it). A tree offered is kept for this step's `propose`."""
        views = [dataclasses.replace(c, state=c.state.suffix, k=self._suffix_depth(c), max_nodes=None)
                 for c in ctxs]
        trees = [self.suffix.propose_one(v) for v in views]
        self._keep(ctxs, views, "suffix")
        out = []
        for c, t in zip(ctxs, trees):
            expected = (t.score or 0.0) * c.state.tally.calibration
            if len(t) > 1 and expected > 0 and (self.min_score is None or expected >= self.min_score):
                c.state.free = (c.root_position, t)
                out.append((t, expected))
            else:
                c.state.free = None
                out.append(None)
        return out

    def propose(self, ctxs):
        trees = [None] * len(ctxs)
        todo = []
        for i, c in enumerate(ctxs):
            free, c.state.free = c.state.free, None
            if free is not None and free[0] == c.root_position:
                trees[i] = free[1]  # the free suffix tree the depth policy chose to verify
            else:
                todo.append(i)
        views = [dataclasses.replace(ctxs[i], state=ctxs[i].state.suffix, k=self._suffix_depth(ctxs[i]),
                                     max_nodes=None) for i in todo]
        for i, t in zip(todo, (self.suffix.propose_one(v) for v in views)):
            trees[i] = t
        self._keep([ctxs[i] for i in todo], views, "suffix")
        fresh, rest = set(todo), []
        for i, (c, t) in enumerate(zip(ctxs, trees)):
            use = i not in fresh or self.takes_suffix(t, c.state.tally)
            c.state.last = (use, t.score or 0.0)
            if not use:
                rest.append(i)
        self.suffix_steps += len(ctxs) - len(rest)
        self.inner_steps += len(rest)
        if rest:
            sub = [ctxs[i] for i in rest]
            views = self._views(sub, "inner")
            for i, tree in zip(rest, self.inner.propose(views)):
                trees[i] = tree
            self._keep(sub, views, "inner")
        return trees

    def on_verified(self, ctxs, results, target_out) -> None:
        for c, res in zip(ctxs, results):
            c.state.free = None
            if c.state.last is not None:
                used, score = c.state.last
                for t, decay in ((c.state.tally, 0.8), (self.tally, 0.95)):
                    t.add(used, score, res.num_accepted, decay)
                c.state.last = None
        views = self._views(ctxs, "inner")
        self.inner.on_verified(views, results, target_out)
        self._keep(ctxs, views, "inner")

    def on_finished(self, ctx: DraftContext) -> None:
        for part, drafter in (("inner", self.inner), ("suffix", self.suffix)):
            (view,) = self._views([ctx], part)
            drafter.on_finished(view)
