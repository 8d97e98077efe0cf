"""The OpenAI-compatible server over one `Engine`: the continuous-batching scheduler (scheduler.py) with its
pool sized from the memory budget, the acceptance monitor and the metrics, and the two generation calls the
routes (serving/app.py) make.

A request's body becomes one `GenerationRequest` (serving/openai_request.py: the validated pydantic model read
once); every choice of it is one `Sequence` in the scheduler, each with its own seed (seed + i) and grammar state.
A full queue answers 429. Responses are shaped by serving/openai_response.py; streaming (serving/stream.py) runs
the scheduler's per-step callback through the incremental detokenizer (and the tool-call parser), so deltas stay
exact when a speculative step emits several tokens; stop strings are held back until decided. A client that
disconnects cancels its sequences: their pool rows are freed before the next step. Special-token strings in
message content and prompts are plain text unless the server is told otherwise.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from ..errors import SpecloomError
from .http_errors import APIError, generation_error
from .openai_request import GenerationRequest, read_request
from .openai_response import Envelope, finish_reason, logprobs_json, message, usage

log = logging.getLogger("specloom.serve")


class Server:
    def __init__(self, engine, model_name: str, api_key: str | None = None, max_num_seqs: int = 16,
                 memory_budget: int | str | None = None, speculation: str | None = None, cost=None,
                 max_queue: int | None = None, kv_dtype=None, start: bool = True,
                 special_tokens_in_input: bool = False, max_body_bytes: int | None = None,
                 metrics_require_key: bool = False, expected_tau: float | None = None):
        """`expected_tau`: the acceptance monitor's start-up figure (tokens per step of the drafter here, e.g.
        from `specloom doctor`); None: the drafter manifest's measured tau (serving/monitor.py)."""
        from ..scheduler import BatchScheduler, parse_size, plan_memory
        from .monitor import attach_monitor
        from ..cost_refresh import startup_curve
        from .metrics import Metrics

        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        if metrics_require_key and not api_key:
            raise SpecloomError("--metrics-require-key needs --api-key (the key /metrics would require)")
        self.metrics_require_key = metrics_require_key  # /metrics behind the API key too (default: open, as vLLM)
        self.special_tokens_in_input = special_tokens_in_input  # True: the old behaviour (content may hold specials)
        from .request_body import MAX_BODY_BYTES

        self.max_body_bytes = max_body_bytes or MAX_BODY_BYTES
        self.created = int(time.time())
        self.metrics = Metrics(model_name)
        if kv_dtype is None:
            kv_dtype = engine.kv_dtype  # the engine's --kv-cache-dtype (None: the model's default)
        self.memory = plan_memory(engine, max_num_seqs, parse_size(memory_budget), kv_dtype)
        rows = self.memory["rows"]
        mode = speculation or ("load_aware" if engine.drafter else "off")
        self.cost_refresh = None  # the verify-cost curve's idle-time check or measurement (cost_refresh.py)
        if mode == "load_aware" and engine.drafter and cost is None:  # ready at once on what is cached (or a
            # one-row probe); the rest happens while no request is running
            cost, self.cost_refresh = startup_curve(engine.model, rows, log=lambda m: print(
                f"specloom: {m}", file=sys.stderr, flush=True))
        self.scheduler = BatchScheduler(engine, rows, mode, cost, max_queue, kv_dtype, on_step=self.metrics.step,
                                        start=start, idle_work=self.cost_refresh.step if self.cost_refresh else None)
        mon = attach_monitor(self.scheduler, expected_tau)
        self.metrics.bind(self.scheduler)
        self.max_n = rows
        log.info("KV pool: %d sequences of %d tokens (%.0f MiB); speculation: %s", rows, self.memory["row_tokens"],
                 self.scheduler.pool.nbytes / 2 ** 20, self.scheduler.policy.mode)
        if engine.drafter is not None and mon.expected_alpha is not None:
            log.info("acceptance monitor: start-up figure tau %.2f (acceptance %.3f at depth %d, from %s); degraded "
                     "below %.2f x that over the last %d drafted steps", mon.expected_tau, mon.expected_alpha,
                     mon.depth, mon.source, mon.fraction, mon.window)

    def close(self) -> None:
        self.scheduler.close()

    def read(self, body: dict, chat: bool) -> GenerationRequest:
        return read_request(body, chat, self)

    def submit(self, req: GenerationRequest, on_tokens=None, on_done=None) -> list:
        """Queue one sequence per choice (choice k = prompt * n + i; each its own seed: seed + i, and its own
        grammar state); `on_tokens` / `on_done`: per-choice callbacks (the scheduler thread calls them)."""
        from ..sampling import SamplingParams
        from ..scheduler import QueueFull, Sequence, ShuttingDown

        seqs = []
        for k in range(req.choices):
            ids, i = req.prompts[k // req.n], k % req.n
            constraint = None
            if req.plan is not None and req.plan.grammar is not None:
                from .grammar import compile_constraint

                constraint = compile_constraint(req.plan.grammar, self.engine.tokenizer,
                                                self.engine.model.config.vocab_size)
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                    seed=None if req.seed is None else req.seed + i, rule=req.sampling_rule,
                                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                    repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias)
            seqs.append(Sequence(ids, req.max_tokens, params, req.stop, constraint=constraint,
                                 on_tokens=on_tokens[k] if on_tokens else None, logprobs=req.logprobs,
                                 on_done=on_done[k] if on_done else None, speculate=req.speculate))
        try:
            self.scheduler.submit(seqs)
        except ShuttingDown as e:
            raise generation_error(e) from None
        except QueueFull as e:
            raise APIError(429, str(e), None, "server_busy", "rate_limit_error") from None
        except SpecloomError as e:
            raise APIError(400, str(e), "max_tokens") from None
        return seqs

    def cancel(self, seqs: list) -> None:
        """Stop and free the sequences still running (the client went away)."""
        running = [seq for seq in seqs if not seq.done.is_set()]
        for seq in running:
            seq.cancel()
        if running:
            self.metrics.abort()

    def finished(self, seq) -> None:
        r = seq.result
        if r is not None:
            ttft = None if seq.t_first is None else seq.t_first - seq.t_submit
            self.metrics.record(r, time.perf_counter() - seq.t_submit, ttft)

    def complete(self, body: dict, chat: bool, gone: threading.Event | None = None) -> dict:
        """A non-streamed response. `gone` set (the client disconnected): cancel the request's sequences."""
        req = self.read(body, chat)
        seqs = self.submit(req)
        while gone is not None and not all(s.done.wait(0.2) for s in seqs):
            if gone.is_set():
                self.cancel(seqs)
                raise APIError(499, "the client closed the request", None, "client_closed")
        choices, results = [], []
        for i, seq in enumerate(seqs):
            try:
                r = seq.wait()
            except Exception as e:
                raise generation_error(e) from None
            self.finished(seq)
            results.append(r)
            fields, called = message(req.plan, (req.echo[i // req.n] if req.echo else "") + r.text, chat)
            lps = None if r.logprobs is None else logprobs_json(self.engine.tokenizer, chat, r.token_ids, r.logprobs)
            choices.append({"index": i, **fields, "finish_reason": finish_reason(r, called), "logprobs": lps})
        return Envelope(chat, self.model_name).body(choices, usage(req.prompts, results))

    def stream(self, body: dict, chat: bool, is_disconnected):
        """The async generator of a streamed response's SSE lines (serving/stream.py). Parsing, validation and
        admission happen here, before the first byte (errors stay HTTP errors, a full queue is a 429)."""
        from .stream import stream

        return stream(self, self.read(body, chat), is_disconnected)
