"""Choosing an EAGLE tree shape (depth, tree_width, num_draft_tokens) from measurements, not constants.

    records = replay(engine, prompts, widths, max_depth)       # the drafter's candidates at sampled positions
    costs = drafting_costs(engine, prompts[0], widths)         # c0, c1(w): drafting in target decode steps
    table = evaluate(records, costs, verify_cost_curve(target))  # every shape: tau, passes, predicted speed-up
    chosen = choose(table)                                     # the cheapest shape not clearly worse than the best

A shape's predicted speed-up over plain decoding is tau / (v(nodes + 1) + c): tau = 1 + the expected number of
accepted drafts per step, v(n) the host's verify-cost curve (one target pass over n tokens, in decode steps;
cost.py: `verify_cost_curve`) and c = c0 + c1(w) x passes the drafting per step (c0: the catch-up pass, the root's head
and the rerank; c1(w): one tree depth over w frontier rows; passes: the depths the expansion runs, early stop
included). Everything the choice depends on is measured for the drafter and host at hand, so a retrained drafter
or another machine gets its own shape from the same function.

Acceptance comes from a replay that is exact for greedy decoding: the target's own greedy continuation of each
calibration prompt is the truth, and at each sampled position the drafter (this code, `EagleDrafter._expand`, no
early stop) expands its candidates once per width to the largest depth. The tree of any (depth, nodes) is a
selection of those candidates -- the expansion to depth j does not depend on the final depth, and the rerank
keeps the best `nodes` candidates no deeper than the depth -- and its accepted length is the number of truth
tokens on one root path of it. So one expansion per width and position prices every depth and node budget, and
the early stop's passes are counted the same way.

The choice (`choose`): the shapes whose predicted speed-up is within one paired standard error of the best one
(differences per calibration prompt, paired on the same positions) are as good as the data can tell; of those the
one with the cheapest step (v + c) is taken: least drafting and verification for the same expected gain, and the
least dependent on deep acceptance, which varies most between domains.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..sampling import SamplingParams
from ..drafters.base import DraftContext

WIDTHS = (1, 2, 3, 4, 6, 8)
NODES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


@dataclass
class Record:
    """One position of one width: per truth-path node j (depth j + 1) its rank among the candidates no deeper
    than each depth d (`rank[j][d - 1]`; absent past the path), per depth j the best frontier score expanded
    from it and the sorted scores of all candidates up to it (the early-stop test)."""

    width: int
    prompt: int
    rank: list[list[int]]
    frontier_best: list[float]
    sorted_scores: list[list[float]]


@dataclass
class Costs:
    """Drafting cost in target decode steps: c0 per step, c1[w] per tree depth of width w."""

    c0: float
    c1: dict
    target_step_s: float
    samples: int


def _drafter(engine):
    from ..drafters.eagle.drafter import EagleDrafter

    d = engine.drafter
    if not isinstance(d, EagleDrafter) or type(d)._catch_up is not EagleDrafter._catch_up:
        raise ValueError("tree-shape replay supports the eagle and eagle3 drafters")
    return d


class _Replay:
    """The drafter positioned anywhere in a known sequence: the target's features of every position computed
    once, the drafter's rows for the committed prefix once, each position's step replayed on top."""

    def __init__(self, engine, seq: list[int], n_prompt: int, depth: int):
        from ..kv import TREE_SLACK

        self.d = _drafter(engine)
        self.engine, self.seq = engine, seq
        self.kv = engine.model.new_kv(len(seq) + TREE_SLACK)
        out = engine.prefill(seq, self.kv, capture=self.d.needs_hidden)
        self.feats = self.d._features(out)[0]  # (L, F): row t = the target's features of position t
        self.ctx = DraftContext(list(seq), n_prompt, SamplingParams(), None, depth, row=0, kv=self.kv,
                                state=self.d.new_state())
        self.store = self.d._stores(self.ctx)[0]
        self.store.truncate(0, row=0)
        self.top = len(seq) - 1  # drafter rows 0..top-1 committed (a one-pass catch-up over the sequence)
        self._catch_up(self.top)

    def _catch_up(self, n: int) -> torch.Tensor:
        """Commit drafter rows up to n - 1 (the root at position n); returns h* (1, H)."""
        first = self.store.lengths[0]
        self.ctx.tokens = self.seq[:n + 1]
        self.ctx.state.feats = [self.feats[first:n]]
        return self.d._catch_up([self.ctx])

    @torch.inference_mode()
    def expand(self, n: int, width: int, depth: int, budget: int | None = None):
        """The candidates of a step whose root sits at position n (drafter rows after n - 1 are overwritten, so
        positions are replayed in decreasing order)."""
        if n > self.top:
            raise ValueError("positions must be replayed in decreasing order")
        self.top = n
        self.store.truncate(n - 1, row=0)
        h = self._catch_up(n)
        self.ctx.k = depth
        try:
            return self.d._expand([self.ctx], h, width, [depth],
                                  None if budget is None else [budget])
        finally:
            self.store.truncate(n, row=0)


def _record(cand, truth: list[int], width: int, depth: int, prompt: int = 0) -> Record:
    toks, scores, parents = cand.tokens[0], cand.scores[0], cand.parents[0]
    d_of = cand.depth_of()
    ids = torch.arange(toks.shape[0])
    rank, cur = [], -1
    for j in range(min(depth, len(truth))):
        hit = ((parents == cur) & (toks == truth[j]) & (d_of == j + 1)).nonzero()
        if hit.numel() == 0:
            break
        i = int(hit[0])
        better = (scores > scores[i]) | ((scores == scores[i]) & (ids < i))  # ranked before node i
        per_depth = torch.zeros(depth, dtype=torch.long).index_add_(0, d_of - 1, better.long())
        rank.append(per_depth.cumsum(0).tolist())  # rank among the candidates no deeper than d = 1..depth
        cur = i
    ends = [sum(cand.sizes[:j + 1]) for j in range(len(cand.sizes))]
    front = [float(scores[f[0]].max()) for f in cand.frontiers]
    sorted_scores = [scores[:e].sort(descending=True).values.tolist() for e in ends]
    return Record(width, prompt, rank, front, sorted_scores)


def replay(engine, prompts: list[list[int]], widths=WIDTHS, max_depth: int = 7, max_new_tokens: int = 96,
           stride: int = 2, progress=None) -> list[Record]:
    """Candidates of the drafter at every `stride`-th position of the target's greedy continuation of each
    prompt, for each width, expanded to `max_depth`."""
    from ..engine import Engine

    plain = Engine(engine.model, engine.tokenizer, None, max_model_len=engine.max_model_len)
    records = []
    for p, ids in enumerate(prompts):
        out = plain.generate(prompt_token_ids=ids, max_tokens=max_new_tokens, ignore_eos=True).token_ids
        seq = list(ids) + out
        rp = _Replay(engine, seq, len(ids), max_depth)
        last = len(seq) - 1 - max_depth  # the truth continues at least max_depth tokens past the root
        for n in range(last, len(ids) - 1, -stride):
            truth = seq[n + 1:n + 1 + max_depth]
            for w in widths:
                records.append(_record(rp.expand(n, w, max_depth), truth, w, max_depth, p))
        if progress:
            progress(p + 1, len(prompts))
    return records


@torch.inference_mode()
def drafting_costs(engine, prompt: list[int], widths=WIDTHS, depth: int = 4, samples: int = 12) -> Costs:
    """c0 and c1(w) in target decode steps, each drafting timed right after a target decode step (so the
    drafter's weights are as cold as in decoding), in rotating order: c0 = a step drafting depth 1 (catch-up,
    the root's head, rerank), c1(w) = (a step drafting `depth` at width w - c0) / (depth - 1)."""
    from ..engine import Engine

    kinds = [("c0", 1, 1)] + [(w, w, depth) for w in widths]
    plain = Engine(engine.model, engine.tokenizer, None, max_model_len=engine.max_model_len)
    new = samples * len(kinds) + 2  # one position per timed drafting
    seq = list(prompt) + plain.generate(prompt_token_ids=prompt, max_tokens=new, ignore_eos=True).token_ids
    rp = _Replay(engine, seq, len(prompt), depth)
    d, m, kv = rp.d, engine.model, rp.kv
    times = {k: [] for k, _, _ in kinds}
    target = []
    n = len(seq) - 1
    for s in range(samples):
        order = kinds[s % len(kinds):] + kinds[:s % len(kinds)]
        for key, w, k in order:
            n -= 1
            kv.truncate(n, row=0)  # one target decode step at this position, then the drafting
            t0 = time.perf_counter()
            m(torch.tensor([[seq[n]]], device=m.device), torch.tensor([[n]], device=m.device), kv.begin([0], [1]))
            kv.truncate(n, row=0)
            t1 = time.perf_counter()
            cand = rp.expand(n, w, k)
            d._select([rp.ctx], cand.tokens, cand.scores, cand.parents, cand.valid([k]), cand.n_keep([k], [w * k]))
            t2 = time.perf_counter()
            target.append(t1 - t0)
            times[key].append(t2 - t1)
    step = statistics.median(target)
    c0 = statistics.median(times["c0"]) / step
    c1 = {w: max(0.0, statistics.median(times[w]) / step - c0) / (depth - 1) for w in widths}
    return Costs(c0, c1, step, samples)


def shapes(max_depth: int = 7, widths=WIDTHS, nodes=NODES) -> list[tuple[int, int, int]]:
    """Candidate (depth, tree_width, num_draft_tokens): chains (d, 1, d) and trees with 2 <= nodes <= what the
    expansion can hold."""
    out = [(d, 1, d) for d in range(1, max_depth + 1)]
    for w in widths:
        if w < 2:
            continue
        for d in range(1, max_depth + 1):
            total = w + (d - 1) * w * w
            out += [(d, w, n) for n in nodes if n <= total and (d > 1 or n == w)]
    return out


def _accepted(r: Record, depth: int, nodes: int) -> int:
    return sum(1 for j, rk in enumerate(r.rank) if j < depth and rk[depth - 1] < nodes)


def _passes(r: Record, depth: int, nodes: int) -> int:
    """Tree passes the expansion runs (EagleDrafter._settled) for this shape at this position."""
    for j in range(1, depth):
        sc = r.sorted_scores[j - 1]
        if len(sc) >= nodes and r.frontier_best[j - 1] <= sc[nodes - 1]:
            return j - 1
    return depth - 1


def evaluate(records: list[Record], costs: Costs, curve, candidates=None, early_stop: bool = True) -> list[dict]:
    """Every candidate shape's tau, acceptance per depth, passes, drafting and verify cost and predicted speed-up,
    best first. `curve`: the one-row verify-cost curve (cost.verify_cost_curve)."""
    by_w: dict[int, list[Record]] = {}
    for r in records:
        by_w.setdefault(r.width, []).append(r)
    rows = []
    for depth, w, nodes in candidates or shapes(max(len(r.sorted_scores) for r in records), sorted(by_w)):
        rs = by_w.get(w)
        if not rs or w not in costs.c1 or len(rs[0].sorted_scores) < depth:
            continue
        acc = [_accepted(r, depth, nodes) for r in rs]
        passes = statistics.mean(_passes(r, depth, nodes) if early_stop else depth - 1 for r in rs)
        tau = 1 + statistics.mean(acc)
        c = costs.c0 + costs.c1[w] * passes
        v = curve(1, nodes + 1)
        per_prompt: dict[int, list[int]] = {}
        for r, x in zip(rs, acc):
            per_prompt.setdefault(r.prompt, []).append(x)
        rows.append({"depth": depth, "tree_width": w, "num_draft_tokens": nodes, "tau": tau,
                     "acceptance_per_depth": [sum(a >= j for a in acc) / len(acc) for j in range(1, depth + 1)],
                     "passes": passes, "draft_cost": c, "verify_cost": v, "predicted_speedup": tau / (v + c),
                     "positions": len(rs),
                     "tau_by_prompt": {p: 1 + statistics.mean(x) for p, x in sorted(per_prompt.items())}})
    rows.sort(key=lambda r: -r["predicted_speedup"])
    return rows


def choose(table: list[dict]) -> dict:
    """Of the shapes not worse than the best predicted one by more than one paired standard error (per prompt:
    the difference of predicted speed-ups on the same positions), the one with the cheapest step (v + c); ties:
    the higher prediction. Each row gets `se_vs_best`."""
    best = table[0]

    def pred_by_prompt(r):
        return {p: t / (r["verify_cost"] + r["draft_cost"]) for p, t in r["tau_by_prompt"].items()}

    bp = pred_by_prompt(best)
    ok = []
    for r in table:
        rp = pred_by_prompt(r)
        diffs = [bp[p] - rp[p] for p in bp if p in rp]
        r["se_vs_best"] = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
        if best["predicted_speedup"] - r["predicted_speedup"] <= r["se_vs_best"]:
            ok.append(r)
    return min(ok, key=lambda r: (r["verify_cost"] + r["draft_cost"], -r["predicted_speedup"]))


def costs_dict(c: Costs) -> dict:
    return asdict(c)
