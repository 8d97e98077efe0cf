"""One speculative step over a set of rows: the heart shared by `Engine.generate` and the serving scheduler.

    trees = drafter.propose([r.ctx for r in rows])                   # all rows in one drafter pass per depth
    trees = [r.constraint.prune(t) for ...]                          # grammar: drafts it rejects are cut
    out   = target(padded trees, kv.begin(rows, sizes), ragged ancestor masks, capture=drafter.needs_hidden)
    per row: constraint.mask -> verify(tree, logits, params, generator) -> kv.commit(path, row)
    drafter.on_verified(ctxs, results, out); per row: stats, constraint.advance, logprobs, emit (EOS/stop/length)

A failure that belongs to one row (its grammar leaves no token, its masking, verification, sampling, commit or
callback) fails that row alone: `row.error` is set, `row.finish` is "error", and the other rows of the step go
on. A drafter failure turns drafting off for the rows it was drafting for, and a tree the target cannot run (a
token id outside the vocabulary, a wrong root) for its row alone: they continue without speculation, and the
output is the target's either way. A target pass with drafts that fails is run once more without them; only a
failed plain target pass fails every row of the step.

Rows sit at any pool rows of `kv` (`row.ctx.row`: the row it was admitted to, for its whole life; a pass runs
over the rows' span, rows between them padding), each with its own sampling parameters and generator, so what a
row emits never depends on what runs beside it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from . import penalties
from .constraint import Constraint
from .drafters.base import DraftContext, Drafter
from .errors import SpecloomError
from .kv import TREE_SLACK
from .models import ForwardOutput
from .results import GenerationResult, Stats, StopChecker, mean_accepted_length
from .sampling import SamplingParams, argmax_ids, coupled_token, sample_token
from .tree import DraftTree
from .verify import verify

log = logging.getLogger("specloom")


@dataclass
class Request:
    """What a caller asks for (the serving scheduler's `Sequence` adds its own bookkeeping)."""

    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    constraint: Constraint | None = None
    on_tokens: object | None = None  # callback(new_ids[, new_logprobs]) -> False to abort
    logprobs: int | None = None  # None: none; k >= 0: each token's logprob and the k most likely alternatives
    t_first: float | None = None  # when the first token was emitted
    speculate: bool = True  # False: this request decodes plainly whatever the engine's drafter (e.g. to compare)
    drafts_in_step: int = 0  # of the tokens the last `on_tokens` call passed, how many were accepted drafts


class Row:
    """One running sequence's decoding state."""

    def __init__(self, req: Request, tokenizer, kv, row: int, device, drafter=None):
        self.req = req
        self.tokenizer = tokenizer
        self.eos = frozenset() if req.ignore_eos else tokenizer.eos_token_ids
        self.stopper = StopChecker(tokenizer, req.stop or [])
        self.generator = None if req.params.greedy else req.params.generator(device)
        self.noise_seed = req.params.noise_seed()  # the coupled rule's key (sampling.py), or None
        self.tokens = list(req.ids)  # the whole sequence; tokens[-1] is the root: chosen, not yet run by the target
        self.out: list[int] = []
        self.finish: str | None = None
        self.text: str | None = None
        self.error: BaseException | None = None
        state = drafter.new_state() if drafter is not None else None
        self.ctx = DraftContext(self.tokens, len(req.ids), req.params, self.generator, 0, row=row, kv=kv, state=state,
                                noise_seed=self.noise_seed)
        self.drafting = drafter is not None and req.speculate
        self.stats = Stats()
        self.t0 = time.perf_counter()
        self.t_prefill = 0.0
        self.draft_s = 0.0
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.prefilled = 0  # prompt tokens in the KV store so far (chunked prefill)
        self.hidden: dict[int, list[torch.Tensor]] = {}  # captured prompt hidden states, gathered over chunks
        self.acc = None  # the depth policy's acceptance counters (serving)

    @property
    def row(self) -> int:
        return self.ctx.row

    @property
    def budget(self) -> int:
        """The most drafted tokens one step may still emit (the token budget less the step's own token)."""
        return max(0, self.req.max_tokens - len(self.out) - 1)

    def stop_drafting(self) -> None:
        """Speculation off for this row for the rest of its request (its drafter state dropped): the one place
        that turns it off, whether the policy or a failing drafter decides."""
        self.drafting = False
        self.ctx.state = None

    def cap(self, drafter) -> int:
        """The deepest draft this row may take now (its drafter's depth, the remaining token budget)."""
        if drafter is None or not self.drafting:
            return 0
        return min(drafter.num_speculative_tokens, self.budget)

    def fail(self, error: BaseException) -> None:
        """This sequence alone ends with `error` (a SpecloomError is the request's fault and its message goes to
        the client; anything else is logged here with its traceback)."""
        if not isinstance(error, SpecloomError):
            log.error("a sequence failed: %s", error, exc_info=error)
        self.error, self.finish = error, "error"

    def record_logprobs(self, rows: torch.Tensor, tokens: list[int]) -> None:
        """rows (len(tokens), V): the target logits each token was chosen from (after any grammar mask)."""
        k = self.req.logprobs
        if k is None:
            return
        lp = torch.log_softmax(rows.float(), -1)
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        tops = lp.topk(k, -1) if k > 0 else None
        for i, c in enumerate(chosen):
            alts = list(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else []
            self.logprobs.append((c, alts))

    def emit(self, emitted: list[int]) -> None:
        """Append a step's tokens; EOS, stop strings and max_tokens cut inside a multi-token step."""
        n_before = len(self.out)
        if self.req.t_first is None:
            self.req.t_first = time.perf_counter()
        for tok in emitted:
            self.out.append(tok)
            self.tokens.append(tok)
            if tok in self.eos:
                self.finish = "stop"
                break
            text = self.stopper.check(self.out)
            if text is not None:
                self.finish, self.text = "stop", text
                break
            if len(self.out) >= self.req.max_tokens:
                self.finish = "length"
                break
        cb = self.req.on_tokens
        if cb is not None and len(self.out) > n_before:
            new = self.out[n_before:]
            # an exact step's tokens are accepted drafts then the target's own one, unless a cut came first
            self.req.drafts_in_step = len(new) - (1 if len(new) == len(emitted) else 0)
            # with logprobs asked, the callback also gets the new tokens' (logprob, alternatives)
            go = cb(new) if self.req.logprobs is None else cb(new, self.logprobs[n_before:len(self.out)])
            if go is False and not self.finish:
                self.finish = "abort"

    def result(self) -> GenerationResult:
        s = self.stats
        return GenerationResult(
            text=self.text if self.text is not None else self.tokenizer.decode(self.out), token_ids=self.out,
            prompt_token_ids=list(self.req.ids), finish_reason=self.finish, num_target_passes=s.passes,
            mean_accepted_length=mean_accepted_length(len(self.out), s.passes), num_draft_tokens=s.drafted,
            num_accepted_tokens=s.accepted, proposed_per_position=s.proposed_at, accepted_per_position=s.accepted_at,
            prefill_seconds=self.t_prefill, total_seconds=time.perf_counter() - self.t0, draft_seconds=self.draft_s,
            logprobs=self.logprobs[:len(self.out)] if self.req.logprobs is not None else None,
        )


@dataclass
class StepPlan:
    """What one step is to do, a value the depth policy (depth.py) hands the step: per row its draft depth (0:
    not drafted) and its tree's node cap (None: the drafter's own size). The step acts on it; nothing else writes a
    step's fields into a row's DraftContext."""

    depths: list[int]
    max_nodes: list[int | None] | None = None

    def nodes(self, i: int) -> int | None:
        return None if self.max_nodes is None else self.max_nodes[i]


@dataclass
class StepReport:
    """What one step did, for the depth policy and the metrics."""

    rows: int
    width: int  # padded tree width T of the target pass
    pass_seconds: float
    draft_seconds: float  # the whole step's drafting (all rows together)
    trees: list[DraftTree]
    accepted: list[int]
    forced: frozenset = frozenset()  # rows whose tree was their grammar's forced tokens (not their drafter's)


def _rows_of(out: ForwardOutput, idx: list[int]) -> ForwardOutput:
    """The pass's captured hidden states of these rows, in this order (row b of the result: idx[b] of the pass):
    what a drafter's `on_verified` reads for its rows."""
    if not out.hidden or idx == list(range(next(iter(out.hidden.values())).shape[0])):
        return out
    i = torch.tensor(idx, device=next(iter(out.hidden.values())).device)
    return ForwardOutput(None, {k: v[i] for k, v in out.hidden.items()})


def prefill_chunk(model, kv, row: int, part: list[int], start: int, capture: tuple[int, ...],
                  hidden: dict[int, list[torch.Tensor]]) -> ForwardOutput:
    """Prompt tokens `part` of KV row `row`, at positions start.., through the target and committed; the hidden
    states `capture` asks for are appended to `hidden[id]` (see `joined`). The one prefill pass of the engine and
    the scheduler, whether a prompt goes in one chunk or in many between decode steps."""
    dev = model.device
    x = torch.tensor([part], device=dev)
    pos = torch.arange(start, start + len(part), device=dev)[None]
    out = model(x, pos, kv.begin([row], [len(part)]), capture=capture, num_logits=1)
    kv.commit(row=row)
    for c in dict.fromkeys(capture):  # ids may repeat (an EAGLE-3 drafter reading one layer twice)
        hidden.setdefault(c, []).append(out.hidden[c])
    return out


def joined(out: ForwardOutput, hidden: dict[int, list[torch.Tensor]]) -> ForwardOutput:
    """The last chunk's logits with every chunk's captured hidden states, in order."""
    if not hidden:
        return out
    return ForwardOutput(out.logits, {c: torch.cat(v, 1) for c, v in hidden.items()})


class Stepper:
    """Runs prefill chunks and speculative steps over rows of one KV store."""

    def __init__(self, model, drafter, kv, tokenizer, prefill_chunk: int = 512):
        self.model, self.drafter, self.kv, self.tokenizer = model, drafter, kv, tokenizer
        self.prefill_chunk = prefill_chunk

    def _target_pass(self, tokens, positions, p, mask, capture) -> ForwardOutput:
        """The step's target pass: replayed as a CUDA graph where one applies (models/graphs.py; the graphs are
        kept with the KV store they write, so every generation over the store replays them), else eager."""
        graphs = self.kv.__dict__.get("_graphs")
        if graphs is None and self.model.device.type == "cuda":
            from .models import graphs as g

            graphs = self.kv.__dict__["_graphs"] = g.GraphedPasses(self.model, self.kv) if g.enabled(self.model) \
                else False
        if graphs and graphs.applies(p, mask):
            return graphs.run(tokens, positions, p, mask, capture)
        return self.model(tokens, positions, p, attn_mask=mask, capture=capture)

    def new_row(self, req: Request, row: int) -> Row:
        return Row(req, self.tokenizer, self.kv, row, self.model.device, self.drafter)

    def finished(self, row: Row) -> None:
        """Tell the drafter that `row` is done (serving, as it retires a row that did not fail). A drafter
        failure here is logged and ignored: the row's output is complete."""
        if self.drafter is None or not row.drafting or row.error is not None:
            return
        try:
            self.drafter.on_finished(row.ctx)
        except Exception:
            log.exception("drafter on_finished failed")

    def _bad_tree(self, tree, row: Row) -> str:
        """Why the target cannot run `tree` for `row` ("" when it can)."""
        if not isinstance(tree, DraftTree):
            return f"not a DraftTree: {type(tree).__name__}"
        if tree.tokens[0] != row.tokens[-1]:
            return f"root {tree.tokens[0]} is not the sequence's last token {row.tokens[-1]}"
        if len(tree) > TREE_SLACK:
            return f"{len(tree)} nodes (at most {TREE_SLACK})"
        vocab = self.model.config.vocab_size
        try:
            if not (0 <= min(tree.tokens) and max(tree.tokens) < vocab):
                return f"a token id outside [0, {vocab})"
        except TypeError:
            return "a token that is not an integer id"
        return ""

    def _drafter_failed(self, rows: list[Row], what: str) -> None:
        log.exception("drafter %s failed: speculation off for %d sequence(s)", what, len(rows))
        for r in rows:
            r.stop_drafting()

    # -- prefill --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, row: Row, budget: int) -> int:
        """Up to `budget` more prompt tokens of `row` (at most `prefill_chunk` at once); after its last chunk the
        first token is sampled and emitted. Returns the tokens prefilled; a failure fails the row alone."""
        req = row.req
        start = row.prefilled
        part = req.ids[start:start + min(budget, self.prefill_chunk)]
        try:
            capture = self.drafter.needs_hidden if row.drafting else ()
            out = prefill_chunk(self.model, self.kv, row.row, part, start, capture, row.hidden)
            row.prefilled += len(part)
            if row.prefilled < len(req.ids):
                return len(part)
            out = joined(out, row.hidden)
            row.hidden = {}
            logits = out.logits[0, -1]
            if penalties.active(req.params):
                penalties.apply(logits[None], req.params, None, req.ids, [])
            if req.constraint is not None:
                req.constraint.mask_row(logits)
            first = (sample_token(logits, req.params, row.generator) if row.noise_seed is None
                     else coupled_token(logits, req.params, row.noise_seed, len(req.ids)))
            if row.drafting:
                t = time.perf_counter()
                try:
                    self.drafter.prefill(row.ctx, out)
                except Exception:
                    self._drafter_failed([row], "prefill")
                row.draft_s += time.perf_counter() - t
            row.t_prefill = time.perf_counter() - row.t0
            if req.constraint is not None:
                req.constraint.advance([first])
            row.record_logprobs(logits[None], [first])
            row.emit([first])
        except Exception as e:
            row.fail(e)
        return len(part)

    # -- the step -------------------------------------------------------------------------------------------
    @property
    def offers_free_drafts(self) -> bool:
        """Whether the drafter has its own `free_drafts` (the default offers none: the policy need not ask)."""
        return getattr(type(self.drafter), "free_drafts", Drafter.free_drafts) is not Drafter.free_drafts

    @torch.inference_mode()
    def free_drafts(self, rows: list[Row], caps: list[int]) -> list:
        """The drafter's free drafts (`Drafter.free_drafts`: no drafter pass) for these rows at these caps."""
        for r, c in zip(rows, caps):
            r.ctx.k, r.ctx.max_nodes, r.ctx.budget = c, None, r.budget
        return self.drafter.free_drafts([r.ctx for r in rows])

    @torch.inference_mode()
    def step(self, rows: list[Row], plan: StepPlan) -> StepReport:
        """One speculative step over `rows` (any pool rows) as `plan` says (each depth capped by the row's own
        cap: its drafter's depth and its token budget)."""
        n = len(rows)
        drafter, dev = self.drafter, self.model.device
        for i, r in enumerate(rows):
            r.ctx.k, r.ctx.max_nodes, r.ctx.budget = min(plan.depths[i], r.cap(drafter)), plan.nodes(i), r.budget
        trees: list[DraftTree] = [DraftTree([r.tokens[-1]], [-1]) for r in rows]
        forced = self._jump_forward(rows, trees)  # grammar-forced tokens: free drafts, in the drafter's place
        drafting = [b for b, r in enumerate(rows) if r.ctx.k > 0 and b not in forced]
        t = time.perf_counter()
        if drafting:
            try:
                proposed = drafter.propose([rows[b].ctx for b in drafting])
                if len(proposed) != len(drafting):
                    raise ValueError(f"{len(proposed)} draft trees for {len(drafting)} sequences")
                for b, tree in zip(drafting, proposed):
                    trees[b] = tree
            except Exception:
                self._drafter_failed([rows[b] for b in drafting], "propose")
                trees = [DraftTree([r.tokens[-1]], [-1]) for r in rows]
            for b in drafting:  # a tree the target cannot run (a bad token id, a wrong root) is that row's alone
                problem = self._bad_tree(trees[b], rows[b])
                if problem:
                    log.error("drafter proposed an unusable tree (%s): speculation off for that sequence", problem)
                    rows[b].stop_drafting()
                    trees[b] = DraftTree([rows[b].tokens[-1]], [-1])
        draft_s = time.perf_counter() - t
        for b, r in enumerate(rows):
            r.draft_s += draft_s / n
            if r.req.constraint is not None and len(trees[b]) > 1:
                try:
                    trees[b] = r.req.constraint.prune(trees[b])
                except Exception as e:
                    r.fail(e)
                    trees[b] = DraftTree([r.tokens[-1]], [-1])

        # one target pass over the padded trees (over the rows' span: rows between them are padding)
        sizes = [len(tr) for tr in trees]
        T = max(sizes)
        p = self.kv.begin([r.row for r in rows], sizes)
        base = [self.kv.lengths[r.row] for r in rows]
        if n == 1:
            tokens = torch.tensor([trees[0].tokens], device=dev)
            positions = torch.tensor([trees[0].positions(base[0])], device=dev)
            mask = None if trees[0].is_chain else trees[0].ancestor_mask(dev)
        else:  # every row of the pass's span: rows between the step's rows are padding at their own next
            # position, seeing themselves (a valid mask, so no NaN reaches a slot that is read later)
            at = [p.span.at(b) for b in range(n)]
            tok = [[0] * T for _ in p.rows]
            pos = [[self.kv.lengths[r]] * T for r in p.rows]
            mask = torch.eye(T, dtype=torch.bool).repeat(len(p.rows), 1, 1) if T > 1 else None
            for b, tree in enumerate(trees):
                s, i = sizes[b], at[b]
                tok[i] = tree.tokens + [0] * (T - s)
                pos[i] = tree.positions(base[b]) + [base[b]] * (T - s)
                if mask is not None and s > 1:
                    mask[i, :s, :s] = tree.ancestor_mask()
            tokens, positions = torch.tensor(tok, device=dev), torch.tensor(pos, device=dev)
            mask = None if mask is None else mask.to(dev)
        capture = drafter.needs_hidden if drafter is not None and any(r.drafting for r in rows) else ()
        t_pass = time.perf_counter()
        try:
            out = self._target_pass(tokens, positions, p, mask, capture)
        except Exception:
            if T == 1:
                raise  # a plain pass failed: nothing of one row's to drop (the caller fails the step's rows)
            # a pass with drafts failed: once more without them (uncommitted KV entries are dropped by begin);
            # speculation goes off for the rows that drafted, the output is the target's either way
            self._drafter_failed([rows[b] for b in drafting], "tree (target pass failed)")
            return self.step(rows, plan)
        pass_s = time.perf_counter() - t_pass

        # per row: mask, verify with its own generator, commit its path
        results = [None] * n
        plain_greedy = [r.req.params.greedy and r.req.constraint is None and not penalties.active(r.req.params)
                        for r in rows]
        best = argmax_ids(out.logits) if sum(plain_greedy) > 1 else None  # one argmax for the step
        at = [p.span.at(b) for b in range(n)]  # row b's place in the pass
        for b, r in enumerate(rows):
            if r.finish:
                continue
            logits = out.logits[at[b], :sizes[b]]
            try:
                if penalties.active(r.req.params):  # each node by the output so far plus its own path's drafts
                    penalties.apply(logits, r.req.params, trees[b], r.req.ids, r.tokens[len(r.req.ids):])
                if r.req.constraint is not None:
                    r.req.constraint.mask(trees[b], logits)
                coupled = {} if r.noise_seed is None else {"coupling": (r.noise_seed, r.ctx.root_position)}
                results[b] = verify(trees[b], logits, r.req.params, r.generator,
                                    best[at[b]][:sizes[b]] if best is not None and plain_greedy[b] else None, **coupled)
                self.kv.commit(results[b].path, row=r.row)
            except Exception as e:
                results[b] = None
                r.fail(e)
        ok = [b for b in range(n) if results[b] is not None and rows[b].drafting]
        if ok:
            t = time.perf_counter()
            try:
                drafter.on_verified([rows[b].ctx for b in ok], [results[b] for b in ok], _rows_of(out, [at[b] for b in ok]))
            except Exception:
                self._drafter_failed([rows[b] for b in ok], "update")
            dt = time.perf_counter() - t
            for b in ok:
                rows[b].draft_s += dt / len(ok)
            draft_s += dt
        for b, r in enumerate(rows):
            res = results[b]
            if res is None:
                continue
            try:
                r.stats.record(trees[b], res.num_accepted)
                if r.req.constraint is not None:
                    r.req.constraint.advance(res.tokens)
                if r.req.logprobs is not None:  # token i of the step was chosen from the logits of path node i
                    r.record_logprobs(out.logits[at[b], torch.tensor(res.path, device=dev)], res.tokens)
                r.emit(res.tokens)
            except Exception as e:
                r.fail(e)
        return StepReport(n, T, pass_s, draft_s, trees, [0 if res is None else res.num_accepted for res in results],
                          frozenset(forced))

    jump_forward = True  # grammar jump-forward (False: measure without it)
    MAX_FORCED = 32  # forced tokens drafted in one step at most

    def _jump_forward(self, rows: list[Row], trees: list[DraftTree]) -> set[int]:
        """Rows whose grammar forces the next tokens get those tokens as their tree this step (a chain the
        masked target verifies; the drafter sits the step out for them, as for any idle row, and catches up
        later). Returns those rows."""
        out = set()
        if not self.jump_forward:
            return out
        for b, r in enumerate(rows):
            c = r.req.constraint
            if c is None or r.budget <= 0 or not hasattr(c, "forced"):
                continue
            try:
                toks = c.forced(min(self.MAX_FORCED, r.budget))
            except Exception:
                toks = []
            if toks:
                trees[b] = DraftTree.chain(r.tokens[-1], toks)
                out.add(b)
        return out
