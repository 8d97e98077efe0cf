"""Continuous batching with speculation: one scheduler thread runs every active sequence through shared steps.

Between steps, waiting requests are admitted into free rows of the KV pool and prefilled under a token budget
(256 prompt tokens per step while others decode: short prompts join several at a time, a long one is cut into
chunks between steps, so it does not stall the others); finished or cancelled ones leave (their row is freed at
once). Each step:

    depth per sequence  <- DepthPolicy (off / fixed / load-aware: batch size + each sequence's acceptance)
    tree per sequence   <- its own drafter (a fork sharing the weights) ; grammar-pruned when constrained
    one target pass     <- all trees padded to the widest, ragged masks (kv_pool.py)
    per sequence        <- grammar mask, exact verify with its own generator, commit its path, drafter update

Each sequence keeps its own sampling parameters, seed and generator, so its output does not depend on what else
runs beside it (greedy: token for token; sampling: the same distribution). Memory: the pool's rows are sized from
the memory budget (target weights + drafter weights + per-row target and drafter KV); a request waits in the
queue for a free row, and is refused (`QueueFull`, HTTP 429) when the queue is full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..drafters import DraftContext
from ..engine import TREE_SLACK, GenerationResult, StopChecker, _Stats, mean_accepted_length
from ..errors import SpecloomError
from ..kv_pool import KVPool
from ..models import ForwardOutput
from ..sampling import SamplingParams, sample_token
from ..tree import DraftTree
from ..verify import verify
from .load_aware import Acceptance, DepthPolicy

log = logging.getLogger("specloom.serve")


class QueueFull(SpecloomError):
    pass


@dataclass
class Sequence:
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    constraint: object | None = None  # serving/grammar.py Constraint
    on_tokens: object | None = None  # callback(new_ids[, new_logprobs]) -> False to abort (scheduler thread)
    logprobs: int | None = None  # None: none; k >= 0: each token's logprob and the k most likely alternatives
    # -- state (the scheduler's) --
    row: int = -1
    cancelled: bool = False
    t_submit: float = 0.0
    t_first: float | None = None  # when the first token was emitted (time to first token = t_first - t_submit)
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled = True

    def wait(self, timeout: float | None = None) -> GenerationResult:
        self.done.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.result


class _Run:
    """A running sequence's decoding state (mirrors Engine.generate's loop variables)."""

    def __init__(self, seq: Sequence, drafter, eos, stopper, acc: Acceptance, device):
        self.seq, self.drafter, self.eos, self.stopper, self.acc = seq, drafter, eos, stopper, acc
        self.generator = None if seq.params.greedy else seq.params.generator(device)
        self.tokens = list(seq.ids)
        self.out: list[int] = []
        self.finish: str | None = None
        self.text: str | None = None
        self.ctx = DraftContext(self.tokens, len(seq.ids), seq.params, self.generator, 0)
        self.stats = _Stats()
        self.t0 = time.perf_counter()
        self.t_prefill = 0.0
        self.draft_s = 0.0
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per emitted token, when asked
        self.prefilled = 0  # prompt tokens in the KV pool so far (chunked prefill)
        self.hidden: dict | None = None  # captured prompt hidden states for the drafter, gathered over chunks

    def record_logprobs(self, rows: torch.Tensor, tokens: list[int]) -> None:
        """rows (len(tokens), V): the target logits each token was chosen from (after any grammar mask)."""
        k = self.seq.logprobs
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
        if self.seq.t_first is None:
            self.seq.t_first = time.perf_counter()
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
            if len(self.out) >= self.seq.max_tokens:
                self.finish = "length"
                break
        cb = self.seq.on_tokens
        if cb is not None and len(self.out) > n_before:
            new = self.out[n_before:]
            # with logprobs asked, the callback also gets the new tokens' (logprob, alternatives)
            go = cb(new) if self.seq.logprobs is None else cb(new, self.logprobs[n_before:len(self.out)])
            if go is False and not self.finish:
                self.finish = "abort"

    def result(self, tokenizer) -> GenerationResult:
        s = self.stats
        return GenerationResult(
            text=self.text if self.text is not None else tokenizer.decode(self.out), token_ids=self.out,
            prompt_token_ids=list(self.seq.ids), finish_reason=self.finish, num_target_passes=s.passes,
            mean_accepted_length=mean_accepted_length(len(self.out), s.passes), num_draft_tokens=s.drafted,
            num_accepted_tokens=s.accepted, proposed_per_position=s.proposed_at, accepted_per_position=s.accepted_at,
            prefill_seconds=self.t_prefill, total_seconds=time.perf_counter() - self.t0, draft_seconds=self.draft_s,
            logprobs=self.logprobs[:len(self.out)] if self.seq.logprobs is not None else None,
        )


class BatchScheduler:
    def __init__(self, engine, rows: int, mode: str = "fixed", cost=None, max_queue: int | None = None,
                 kv_dtype: torch.dtype | None = None, on_step=None, start: bool = True):
        """`start` False: the caller runs `run()` itself -- on CPU, from the main thread: PyTorch's OpenMP
        thread team belongs to the thread that first used it, and steps from another thread ran ~40 % slower
        here (measured: 34 vs 49 ms per SmolLM2 decode step on 2 cores)."""
        self.engine = engine
        self.model = engine.model
        self.row_len = engine.max_model_len + TREE_SLACK
        self.pool = KVPool(self.model, rows, self.row_len, kv_dtype)
        k = engine.drafter.num_speculative_tokens if engine.drafter else 0
        self.policy = DepthPolicy(mode if k else "off", k, cost)
        self.max_queue = 4 * rows if max_queue is None else max_queue
        spec = engine.speculative_config
        self.disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self.on_step = on_step  # callback(batch_size, depths) for metrics
        self.waiting: deque[Sequence] = deque()
        self.running: list[_Run] = []  # running[i].seq.row == i
        self.prefilling: _Run | None = None  # admitted, prompt partly prefilled; its row is len(running)
        self.prefill_budget = 256  # prompt tokens prefilled per scheduler iteration while others are decoding
        self.cv = threading.Condition()
        self._closed = False
        self.steps = 0
        self._last_top, self._last_log = -1, 0.0
        self._t1 = cost.base if cost is not None else None
        self.thread = None
        if start:
            self.thread = threading.Thread(target=self.run, name="specloom-scheduler", daemon=True)
            self.thread.start()

    # -- public ----------------------------------------------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences (all or none). Raises QueueFull when the queue has no room for them."""
        for s in seqs:
            if len(s.ids) + s.max_tokens > self.engine.max_model_len:
                raise SpecloomError(
                    f"the prompt has {len(s.ids)} tokens and max_tokens is {s.max_tokens}: together they exceed the "
                    f"model's context of {self.engine.max_model_len} tokens")
        with self.cv:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue + self.pool.free_rows:
                raise QueueFull(
                    f"the server is at capacity ({self.pool.rows} sequences running, {len(self.waiting)} waiting); "
                    "retry later")
            now = time.perf_counter()
            for s in seqs:
                s.t_submit = now
            self.waiting.extend(seqs)
            self.cv.notify()

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.prefilling is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> None:
        """The scheduling loop; returns after `close()`."""
        while True:
            with self.cv:
                while not self._closed and not self.waiting and not self.running and self.prefilling is None:
                    self.cv.wait()
                if self._closed:
                    pending = [r.seq for r in self.running] + ([self.prefilling.seq] if self.prefilling else [])
                    for s in list(self.waiting) + pending:
                        s.error = QueueFull("the server shut down")
                        s.done.set()
                    return
            # prefill under a token budget per iteration (vLLM's chunked prefill): short prompts join several at a
            # time, a long one is cut into chunks between the running sequences' steps
            budget = self.prefill_budget if self.running else self.engine.prefill_chunk
            while budget > 0:
                if self.prefilling is None:
                    seq = self._next_waiting()
                    if seq is None:
                        break
                    self._admit(seq)
                budget -= self._prefill_chunk(budget)
                if self.prefilling is not None:  # a partial prompt: continue after the next step
                    break
            self._retire()
            if self.running:
                try:
                    self._step()
                except Exception as e:  # a bug: fail the running sequences, keep serving
                    log.exception("scheduler step failed")
                    for r in list(self.running):
                        r.seq.error = e
                        r.finish = "error"
                    self._retire()

    # -- admission: chunked prefill, interleaved with the others' steps -----------------------------------------
    def _next_waiting(self) -> Sequence | None:
        with self.cv:
            while self.waiting and self.pool.free_rows:
                s = self.waiting.popleft()
                if not s.cancelled:
                    return s
                s.error = SpecloomError("cancelled")
                s.done.set()
        return None

    def _admit(self, seq: Sequence) -> None:
        eng = self.engine
        eos = frozenset() if seq.ignore_eos else eng.tokenizer.eos_token_ids
        drafter = eng.drafter.fork() if eng.drafter else None
        run = _Run(seq, drafter, eos, StopChecker(eng.tokenizer, seq.stop), self.policy.new_acceptance(),
                   self.model.device)
        seq.row = self.pool.allocate()  # = len(self.running): the row after the running block
        run.hidden = {c: [] for c in (drafter.needs_hidden if drafter else ())}
        self.prefilling = run

    @torch.inference_mode()
    def _prefill_chunk(self, budget: int) -> int:
        """Up to `budget` more prompt tokens of the prefilling sequence; after its last chunk it samples the first
        token and joins the running block. Returns the tokens prefilled."""
        run = self.prefilling
        seq = run.seq
        if seq.cancelled:
            self._drop_prefilling(None)
            return 0
        part = []
        try:
            start = run.prefilled
            chunk = min(budget, self.engine.prefill_chunk)
            part = seq.ids[start:start + chunk]
            dev = self.model.device
            x = torch.tensor([part], device=dev)
            pos = torch.arange(start, start + len(part), device=dev)[None]
            capture = tuple(run.hidden)
            out = self.model(x, pos, self.pool.batch([seq.row], [len(part)]), capture=capture, num_logits=1)
            self.pool.commit(seq.row)
            for c in capture:
                run.hidden[c].append(out.hidden[c])
            run.prefilled += len(part)
            if run.prefilled < len(seq.ids):
                return len(part)
            if capture:
                out = ForwardOutput(out.logits, {c: torch.cat(v, 1) for c, v in run.hidden.items()})
            run.hidden = None
            logits = out.logits[0, -1]
            if seq.constraint is not None:
                logits = logits.clone()
                seq.constraint.mask_row(logits)
            first = sample_token(logits, seq.params, run.generator)
            if run.drafter:
                t = time.perf_counter()
                run.drafter.prefill(run.ctx, out)
                run.draft_s += time.perf_counter() - t
            run.t_prefill = time.perf_counter() - run.t0
            if seq.constraint is not None:
                seq.constraint.advance([first])
            run.record_logprobs(logits[None], [first])
            run.emit([first])
        except Exception as e:
            self._drop_prefilling(e)
            return len(part)
        self.prefilling = None
        self.running.append(run)  # its row is len(running) - 1: the running block stays contiguous
        return len(part)

    def _drop_prefilling(self, error: BaseException | None) -> None:
        run, self.prefilling = self.prefilling, None
        run.finish = "abort" if error is None else "error"
        seq = run.seq
        if error is not None:
            seq.error = error
        else:
            seq.result = run.result(self.engine.tokenizer)
        self.pool.release(seq.row)  # the last active row: nothing moves
        seq.done.set()

    def _retire(self) -> None:
        """Finish and remove sequences that are done or cancelled; their pool rows are freed at once. The last
        running row moves into the hole (and a prefilling row, which sits after the running block, moves down
        one), so the running rows stay 0..n-1."""
        i = 0
        while i < len(self.running):
            run = self.running[i]
            if run.seq.cancelled and not run.finish:
                run.finish = "abort"
            if not run.finish:
                i += 1
                continue
            seq = run.seq
            if seq.error is None:
                seq.result = run.result(self.engine.tokenizer)
            last = self.running.pop()
            if last is not run:  # the last running row moves into the hole
                self.pool.move(last.seq.row, seq.row)
                last.seq.row = seq.row
                self.running[seq.row] = last
            if self.prefilling is not None:  # keep the prefilling row right after the running block
                self.pool.move(self.prefilling.seq.row, len(self.running))
                self.prefilling.seq.row = len(self.running)
            self.pool.pop()
            seq.done.set()

    @torch.inference_mode()
    def _step(self) -> None:
        runs = self.running
        n = len(runs)
        off = self.disable_by_batch_size is not None and n >= self.disable_by_batch_size  # vLLM's key
        caps = [0 if off or not r.drafter else min(r.drafter.num_speculative_tokens, r.seq.max_tokens - len(r.out) - 1)
                for r in runs]
        ks = self.policy.choose([r.acc.alpha for r in runs], caps)
        trees, draft_times = [], []
        for r, k in zip(runs, ks):
            r.ctx.k = k
            # a shallower tree keeps proportionally fewer nodes (tree size follows the chosen depth)
            nodes = getattr(r.drafter, "num_nodes", None)
            full = r.drafter.num_speculative_tokens if r.drafter else 0
            shrink = self.policy.mode == "load_aware" and nodes and 0 < k < full  # not for the budget's own cut
            r.ctx.max_nodes = max(k, -(-nodes * k // full)) if shrink else None
            t = time.perf_counter()
            tree = r.drafter.propose(r.ctx) if k > 0 else DraftTree([r.tokens[-1]], [-1])
            dt = time.perf_counter() - t
            r.draft_s += dt
            draft_times.append(dt)
            if r.seq.constraint is not None and len(tree) > 1:
                tree = r.seq.constraint.prune(tree)
            trees.append(tree)
        sizes = [len(t) for t in trees]
        T = max(sizes)
        dev = self.model.device
        tokens = torch.zeros(n, T, dtype=torch.long)
        positions = torch.zeros(n, T, dtype=torch.long)
        mask = torch.eye(T, dtype=torch.bool).repeat(n, 1, 1) if T > 1 else None
        for b, (r, tree) in enumerate(zip(runs, trees)):
            s, base = sizes[b], self.pool.lengths[b]
            tokens[b, :s] = torch.tensor(tree.tokens)
            positions[b, :s] = torch.tensor(tree.positions(base))
            positions[b, s:] = base
            if mask is not None and s > 1:
                mask[b, :s, :s] = tree.ancestor_mask()
        capture = tuple(sorted({c for r in runs if r.drafter for c in r.drafter.needs_hidden}))
        t_pass = time.perf_counter()
        out = self.model(tokens.to(dev), positions.to(dev), self.pool.batch(range(n), sizes),
                         attn_mask=None if mask is None else mask.to(dev), capture=capture)
        if self.policy.cost is not None and self.policy.mode == "load_aware":
            self.policy.cost.observe(n, T, time.perf_counter() - t_pass)
        self.steps += 1
        for b, (r, tree) in enumerate(zip(runs, trees)):
            s = sizes[b]
            logits = out.logits[b, :s]
            if r.seq.constraint is not None:
                logits = logits.clone()
                r.seq.constraint.mask(tree, logits)
            res = verify(tree, logits, r.seq.params, r.generator)
            self.pool.commit(b, res.path)
            if r.drafter:
                t = time.perf_counter()
                sub = ForwardOutput(logits[None], {c: out.hidden[c][b:b + 1, :s] for c in r.drafter.needs_hidden})
                r.drafter.on_verified(r.ctx, res, sub)
                r.draft_s += time.perf_counter() - t
            r.stats.record(tree, res)
            self.policy.observe(r.acc, tree.max_depth, len(tree), res.num_accepted, draft_times[b], self._t1)
            if r.seq.constraint is not None:
                r.seq.constraint.advance(res.tokens)
            if r.seq.logprobs is not None:  # token i of the step was chosen from the logits of path node i
                r.record_logprobs(logits[torch.tensor(res.path, device=logits.device)], res.tokens)
            r.emit(res.tokens)
        if self.on_step is not None:
            self.on_step(n, ks)
        top = max(ks)
        now = time.monotonic()
        if top != self._last_top and now - self._last_log >= 1.0:  # load-aware depth in the log (at most 1/s)
            log.info("%s speculation: %d running -> draft depth %d (per sequence %s)", self.policy.mode, n, top, ks)
            self._last_top, self._last_log = top, now
        if self.steps % 200 == 0:
            log.info("step %d: %d running, %d waiting, depth per sequence %s", self.steps, n, len(self.waiting), ks)
