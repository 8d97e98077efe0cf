"""Continuous batching with speculation: the scheduler around the one speculative step (step.py).

Between steps, waiting requests are admitted into free rows of the KV pool and prefilled under a token budget
(256 prompt tokens per step while others decode: short prompts join several at a time, a long one is cut into
chunks between steps, so it does not stall the others); finished, failed or cancelled ones leave (their row is
freed at once; rows are addressed by index, so no other row moves). Each step:

    plan = policy.plan(stepper, rows)   <- DepthPolicy (off / fixed / load-aware: batch size + acceptance)
    rep = stepper.step(rows, plan)      <- all rows drafted together, one target pass, per-row verify, commit
    policy.observe(rows, plan, rep)     <- the cost curve, each sequence's acceptance, the drafting cost

This module keeps admission, the prefill budget, retiring, cancellation and threading; everything a step does
lives in step.py, shared with `Engine.generate`. Each sequence keeps its own sampling parameters, seed and
generator, so its output does not depend on what else runs beside it (greedy: token for token; sampling: the
same distribution), and a failure of one sequence fails its request alone. Memory: the pool's rows are sized
from the memory budget (target weights + drafter weights + per-row target and drafter KV); a request waits in the
queue for a free row, and is refused (`QueueFull`, HTTP 429) when the queue is full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .errors import SpecloomError
from .results import GenerationResult
from .step import Request, Row, Stepper
from .kv import TREE_SLACK
from .depth import DepthPolicy

log = logging.getLogger("specloom.serve")


class QueueFull(SpecloomError):
    pass


class ShuttingDown(SpecloomError):
    """The server is draining (SIGTERM): a new request is refused, and an accepted one still running when the
    grace period runs out ends with this (HTTP 503)."""


@dataclass
class Sequence(Request):
    """A request with the scheduler's bookkeeping (`on_tokens` is called from the scheduler thread)."""

    row: int = -1
    cancelled: bool = False
    t_submit: float = 0.0
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_done: object | None = None  # callback(seq), called from the scheduler thread when it finishes or fails

    def cancel(self) -> None:
        self.cancelled = True

    def settle(self, error: BaseException | None = None) -> None:
        """Done (failed with `error`, when given): wake the waiters and call `on_done` (a caller's callback must
        not stop the scheduler)."""
        if error is not None:
            self.error = error
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:
                log.exception("on_done callback failed")

    def wait(self, timeout: float | None = None) -> GenerationResult:
        self.done.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.result


class BatchScheduler:
    def __init__(self, engine, rows: int, mode: str = "fixed", cost=None, max_queue: int | None = None,
                 kv_dtype: torch.dtype | None = None, on_step=None, start: bool = True, monitor=None, idle_work=None):
        """`start` False: the caller runs `run()` itself -- on CPU, from the main thread: PyTorch's OpenMP
        thread team belongs to the thread that first used it, and steps from another thread ran ~40 % slower
        here (measured: 34 vs 49 ms per SmolLM2 decode step on 2 cores). `monitor`: a live acceptance monitor
        handed in by the server (`observe(trees, accepted)`, `degraded`, `alpha`: serving/monitor.py's
        `attach_monitor`), or None; `on_step(batch_size, depths)`: the server's metrics. `idle_work()`: called
        while nothing is queued or running (e.g. cost_refresh.CurveRefresh.step: verify-cost passes in idle time),
        returns how long to wait before calling it again (0: at once; None: never)."""
        self.engine = engine
        self.model = engine.model
        self.drafter = engine.drafter
        self.pool = self.model.new_kv(engine.max_model_len + TREE_SLACK, kv_dtype, batch=rows, active=0)
        self.stepper = Stepper(self.model, self.drafter, self.pool, engine.tokenizer, engine.prefill_chunk)
        prior = engine.prior_tau() if self.drafter else None
        self.policy = DepthPolicy.for_drafter(mode, self.drafter, cost, prior)
        # the drafter's manifest tau (None: unknown), read again: the policy may have re-chosen its tree
        self.prior_tau = engine.prior_tau() if self.drafter else None
        self.monitor = monitor
        self._prior_alpha = self.policy.prior_alpha  # the policy's prior from the manifest, restored on recovery
        self.max_queue = 4 * rows if max_queue is None else max_queue
        spec = engine.speculative_config
        self.disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self.on_step = on_step  # callback(batch_size, depths) for metrics
        self.waiting: deque[Sequence] = deque()
        self.running: list[Row] = []  # running[i].row == i
        self.prefilling: Row | None = None  # admitted, prompt partly prefilled; its row is len(running)
        self.prefill_budget = 256  # prompt tokens prefilled per scheduler iteration while others are decoding
        self.cv = threading.Condition()
        self._closed = False
        self._drain_until: float | None = None  # set by drain(): admit nothing new, stop when idle or at this time
        self._drain_timeout = 0.0
        self.idle_work = idle_work
        self.steps = 0
        self._last_top, self._last_log = -1, 0.0
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
            if self._closed or self._drain_until is not None:
                raise ShuttingDown("the server is shutting down and admits no new request")
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

    def drain(self, timeout: float) -> None:
        """Admit no new sequence (`submit` raises ShuttingDown); `run()` returns once every accepted one (running
        or waiting) is done, or after `timeout` seconds fails those left with ShuttingDown."""
        with self.cv:
            self._drain_until = time.monotonic() + timeout
            self._drain_timeout = timeout
            self.cv.notify()

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> None:
        """The scheduling loop; returns after `close()` or, once `drain()` was called, when the accepted sequences
        are done or the grace period is over (those left fail with ShuttingDown). An exception that escapes an iteration (a bug outside
        the step's own per-row handling) is logged and fails only the sequences it could have touched; the loop
        goes on serving."""
        pause = 0.0  # before the next idle work (None: none left)
        while True:
            with self.cv:
                idle = not self.waiting and not self.running and self.prefilling is None
                while not self._closed and self._drain_until is None and idle:
                    if self.idle_work is not None and pause is not None and pause <= 0:
                        break
                    woke = self.cv.wait(pause if self.idle_work is not None else None)
                    if not woke and pause is not None:
                        pause = 0.0
                    idle = not self.waiting and not self.running and self.prefilling is None
                late = self._drain_until is not None and time.monotonic() >= self._drain_until
                if self._closed or late or (self._drain_until is not None and idle):
                    why = f" (the shutdown grace period of {self._drain_timeout:g} s ran out)" if late else ""
                    error = ShuttingDown(f"the server shut down before this request finished{why}")
                    pending = [r.req for r in self.running] + ([self.prefilling.req] if self.prefilling else [])
                    for s in list(self.waiting) + pending:
                        s.settle(error)
                    return
            if idle:  # nothing to serve: one slice of idle work (a request arriving now waits for one pass)
                try:
                    pause = self.idle_work()
                except Exception:
                    log.exception("idle work failed; it is dropped")
                    pause = None
                if pause is None:
                    self.idle_work = None
                continue
            try:
                self._iterate()
            except Exception as e:
                log.exception("scheduler iteration failed")
                self._fail_active(e)

    def _iterate(self) -> None:
        """Admit and prefill under the budget, retire, one step, retire."""
        # prefill under a token budget per iteration (vLLM's chunked prefill): short prompts join several at a
        # time, a long one is cut into chunks between the running sequences' steps
        budget = self.prefill_budget if self.running else self.engine.prefill_chunk
        while budget > 0:
            if self.prefilling is None:
                if not self._admit():
                    break
                if self.prefilling is None:  # that one failed to start; try the next
                    continue
            row = self.prefilling
            if row.req.cancelled:
                row.finish = "abort"
            else:
                budget -= self.stepper.prefill(row, budget)
            if row.finish:  # failed or cancelled while prefilling
                self.prefilling = None
                self._finish(row)
                self.pool.free(row.row)
            elif row.prefilled == len(row.req.ids):
                self.running.append(row)
                self.prefilling = None
            else:  # a partial prompt: continue after the next step
                break
        self._retire()
        if self.running:
            try:
                self._step()
            except Exception as e:  # the target pass itself failed: fail the running sequences, keep serving
                log.exception("scheduler step failed")
                for r in self.running:
                    r.fail(e)
            self._retire()

    def _admit(self) -> bool:
        """Start prefilling the next waiting sequence in the lowest free row; False when none can
        start. A sequence whose row cannot be set up fails alone."""
        seq = self._next_waiting()
        if seq is None:
            return False
        allocated = False
        try:
            seq.row = self.pool.allocate()
            allocated = True
            row = self.stepper.new_row(seq, seq.row)
            self.policy.admit(row, self.drafter)
        except Exception as e:
            log.exception("admitting a sequence failed")
            if allocated:
                self.pool.free(seq.row)
            seq.settle(e)  # a SpecloomError reaches its client as a 400, anything else as a 500
            return True  # the next waiting one may start
        self.prefilling = row
        return True

    def _fail_active(self, error: BaseException) -> None:
        """The last resort after an unexpected failure between steps: the running and prefilling sequences fail
        (the pool rows they hold can no longer be trusted), every row is freed, waiting ones stay queued."""
        rows = self.running + ([self.prefilling] if self.prefilling is not None else [])
        self.running, self.prefilling = [], None
        for row in rows:
            if not row.req.done.is_set():
                row.req.settle(row.error or error)
        try:
            for r in self.pool.used_rows():
                self.pool.free(r)
        except Exception:
            log.exception("freeing the KV pool failed")

    def _next_waiting(self) -> Sequence | None:
        with self.cv:
            while self.waiting and self.pool.free_rows:
                s = self.waiting.popleft()
                if not s.cancelled:
                    return s
                s.settle(SpecloomError("cancelled"))
        return None

    def _finish(self, row: Row) -> None:
        seq = row.req
        if row.error is None:
            try:
                seq.result = row.result()
            except Exception as e:  # e.g. its text does not decode: this sequence fails (logged), no other
                row.fail(e)
        if row.error is None:
            self.stepper.finished(row)  # before the caller sees it: its next request can draft from this one
        seq.settle(row.error)

    def _retire(self) -> None:
        """Finish and remove sequences that are done, failed or cancelled; their pool rows are freed at once (no
        other row moves)."""
        keep = []
        for row in self.running:
            if row.req.cancelled and not row.finish:
                row.finish = "abort"
            if not row.finish:
                keep.append(row)
                continue
            self._finish(row)
            self.pool.free(row.row)
        self.running = keep

    def _monitor(self, rep) -> None:
        """Feed the acceptance monitor; while it says the drafter is degraded, the load-aware policy's prior
        (the acceptance a request is judged at during its first drafted steps, `DepthPolicy.alpha`, and at
        admission) is the measured rolling acceptance instead of the manifest's figure: otherwise every new
        request would draft its trial steps at an acceptance the drafter no longer has. Back to the manifest's
        once the monitor sees the acceptance recover (idle rows are still probed, so it can)."""
        m = self.monitor
        if m is None:
            return
        mine = [i for i in range(len(rep.trees)) if i not in rep.forced]  # grammar-forced trees are not the drafter's
        m.observe([rep.trees[i] for i in mine], [rep.accepted[i] for i in mine])
        if self.policy.mode != "load_aware":
            return
        if m.degraded and m.alpha is not None:
            self.policy.prior_alpha = min(self._prior_alpha, m.alpha)
        else:
            self.policy.prior_alpha = self._prior_alpha

    def _step(self) -> None:
        rows = self.running
        n = len(rows)
        off = self.disable_by_batch_size is not None and n >= self.disable_by_batch_size  # vLLM's key
        caps = [0 if off else r.cap(self.drafter) for r in rows]
        plan = self.policy.plan(self.stepper, rows, caps)  # depths and tree sizes: advice, a value
        rep = self.stepper.step(rows, plan)
        self.policy.observe(rows, plan, rep)  # calibration, acceptance, drafting cost
        ks = plan.depths
        self.steps += 1
        try:
            self._monitor(rep)
        except Exception:  # monitoring must not fail the requests
            log.exception("acceptance monitor failed")
        if self.on_step is not None:
            try:
                self.on_step(n, ks)
            except Exception:  # metrics must not fail the requests
                log.exception("on_step callback failed")
        top = max(ks)
        now = time.monotonic()
        if top != self._last_top and now - self._last_log >= 1.0:  # load-aware depth in the log (at most 1/s)
            log.info("%s speculation: %d running -> draft depth %d (per sequence %s)", self.policy.mode, n, top, ks)
            self._last_top, self._last_log = top, now
        if self.steps % 200 == 0:
            log.info("step %d: %d running, %d waiting, depth per sequence %s", self.steps, n, len(self.waiting), ks)


# -- sizing the pool ---------------------------------------------------------------------------------------------
def parse_size(text: str | int | None) -> int | None:
    """'4GiB', '512MB', '2g', '1500000000' -> bytes (None stays None)."""
    if text is None or isinstance(text, int):
        return text
    t = str(text).strip().lower().replace(" ", "")
    units = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "kib": 2 ** 10, "m": 10 ** 6, "mb": 10 ** 6, "mib": 2 ** 20,
             "g": 10 ** 9, "gb": 10 ** 9, "gib": 2 ** 30, "t": 10 ** 12, "tb": 10 ** 12, "tib": 2 ** 40}
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise SpecloomError(f"cannot read the memory size {text!r} (examples: 4GiB, 512MB, 2000000000)")
    return int(value * units[unit])


def plan_memory(engine, max_num_seqs: int, budget: int | None, kv_dtype=None) -> dict:
    """How many sequences fit: budget - target weights - drafter weights - activations, divided by one row's
    target KV (max_model_len + tree slack) plus the drafter's own KV for that row, each at its own KV type
    (`kv_dtype` for the target, the spec's `kv_cache_dtype` for the drafter; a quantized type's scales counted).
    Without a budget: max_num_seqs rows. Raises SpecloomError when not even one sequence fits."""
    from .drafters.base import module_bytes
    from .kv import kv_bytes_per_token
    from .kv_quant import kv_type

    model, drafter = engine.model, engine.drafter
    row_len = engine.max_model_len + TREE_SLACK
    weights = module_bytes(model)
    dmem = drafter.memory() if drafter else {"weights": 0, "kv_per_1k_tokens": 0}
    c = model.config
    target_row = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, model.kv_dtype(kv_dtype)) * row_len
    drafter_row = dmem["kv_per_1k_tokens"] * row_len // 1000  # a drafter's companion row is as long as the target's
    k = drafter.num_speculative_tokens if drafter else 0
    widest = max(1, k * 4 + 1)  # padded tree width bound used for the activation estimate
    per_row_act = widest * (model.config.vocab_size * 4 * 2 + model.config.hidden_size * 4 * 16)
    plan = {"target_weights": weights, "drafter_weights": dmem["weights"], "target_kv_per_row": target_row,
            "drafter_kv_per_row": drafter_row, "activations_per_row": per_row_act, "row_tokens": row_len,
            "budget": budget, "target_kv_dtype": kv_type(model.kv_dtype(kv_dtype)).label,
            "drafter_kv_dtype": _drafter_kv_label(drafter)}
    if budget is None:
        plan["rows"] = max_num_seqs
    else:
        free = budget - weights - dmem["weights"]
        rows = min(max_num_seqs, free // (target_row + drafter_row + per_row_act)) if free > 0 else 0
        if rows < 1:
            mb = 2 ** 20
            raise SpecloomError(
                f"--memory-budget {budget / mb:.0f} MiB is too small: target weights {weights / mb:.0f} MiB + drafter "
                f"weights {dmem['weights'] / mb:.0f} MiB + one sequence of {engine.max_model_len} tokens "
                f"({(target_row + drafter_row + per_row_act) / mb:.0f} MiB of KV cache and activations) do not fit; "
                "raise the budget or lower --max-model-len")
        plan["rows"] = int(rows)
    return plan


def _drafter_kv_label(drafter) -> str | None:
    """The drafter's own KV type as reports name it (None: no drafter or none of its own)."""
    inner = getattr(drafter, "inner", drafter)  # suffix decoding in front: the model drafter's
    if inner is None or not getattr(inner, "keeps_kv", False):
        return None
    t = inner.kv_cache_dtype
    return t.label if t is not None else "default"
