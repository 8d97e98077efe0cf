"""OpenAI-compatible HTTP API over one `Engine`, served by the continuous-batching scheduler (scheduler.py).

Endpoints: `GET /health` (200 "ok" when ready, 503 "starting" / "draining" otherwise: serving/lifecycle.py),
`GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions` (a text, texts, token
ids or lists of token ids), `POST /v1/chat/completions` (SSE streaming with `stream_options.include_usage`, `n`,
`stop`, `seed`, `temperature`, `top_p`, `max_tokens`; `tools` / `tool_choice` and `response_format` through
serving/tools.py and grammar.py). Every body is read under a size and nesting limit (serving/request_body.py) and
checked against its pydantic model (serving/schemas.py, also the OpenAPI document's request schemas) before
anything else. Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}` with 400 / 401 / 404 /
413 / 429 / 503; the API key (when set) is checked on every `/v1` route (and on `/metrics` when the server is told
to), in constant time. Special-token strings in
message content and prompts are plain text unless the server is told otherwise. `/metrics`: Prometheus counters,
gauges and histograms (serving/metrics.py).

Every choice of a request is one `Sequence` in the scheduler; the pool holds as many as the memory budget allows
(`plan_memory`), a full queue answers 429. Streaming runs the scheduler's per-step callback through the
incremental detokenizer (and the tool-call parser), so deltas stay exact when a speculative step emits several
tokens; stop strings are held back until decided. A client that disconnects cancels its sequences: their pool
rows are freed before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import threading
import time
import uuid

from fastapi import Request  # module level: FastAPI resolves the handlers' (postponed) annotations here

from ..errors import SpecloomError
from .detokenize import IncrementalDetokenizer
from .http_errors import APIError, generation_error

log = logging.getLogger("specloom.serve")


def _int(body: dict, key: str, default, lo: int, hi: int):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise APIError(400, f"{key} must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise APIError(400, f"{key} must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        return [s]
    if isinstance(s, list) and all(isinstance(x, str) for x in s) and len(s) <= 4:
        return s
    raise APIError(400, "stop must be a string or a list of at most 4 strings", "stop")


class _StopHold:
    """Releases streamed text only once it cannot be the start of a stop string; cuts at the first stop."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.text += delta
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        elif final or not self.stops:
            end = len(self.text)
        else:
            hold = 0
            for s in self.stops:
                for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if s.startswith(self.text[-n:]):
                        hold = max(hold, n)
                        break
            end = len(self.text) - hold
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


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
    from ..drafters.base import module_bytes
    from ..kv import kv_bytes_per_token
    from ..kv_quant import kv_type
    from ..kv import TREE_SLACK

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


class Server:
    def __init__(self, engine, model_name: str, api_key: str | None = None, max_num_seqs: int = 16,
                 memory_budget: int | str | None = None, speculation: str | None = None, cost=None,
                 max_queue: int | None = None, kv_dtype=None, start: bool = True,
                 special_tokens_in_input: bool = False, max_body_bytes: int | None = None,
                 metrics_require_key: bool = False, expected_tau: float | None = None):
        """`expected_tau`: the acceptance monitor's start-up figure (tokens per step of the drafter here, e.g.
        from `specloom doctor`); None: the drafter manifest's measured tau (serving/monitor.py)."""
        from ..scheduler import BatchScheduler
        from .monitor import attach_monitor
        from ..cost import batch_cost_cached
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
        if mode == "load_aware" and engine.drafter and cost is None:
            cost = batch_cost_cached(engine.model, rows, log=lambda m: print(f"specloom: {m}", file=sys.stderr,
                                                                               flush=True))
        self.scheduler = BatchScheduler(engine, rows, mode, cost, max_queue, kv_dtype, on_step=self.metrics.step,
                                        start=start)
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

    # -- request parsing -------------------------------------------------------------------------------------
    def _common(self, body: dict) -> dict:
        if body.get("model") not in (None, self.model_name):
            raise APIError(404, f"The model {body.get('model')!r} does not exist (this server serves "
                                f"{self.model_name!r})", "model", "model_not_found")
        ctx = self.engine.max_model_len
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise APIError(400, "stream_options must be an object", "stream_options")
        mt_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return {
            "max_tokens": _int(body, mt_key, min(256, ctx - 1), 1, ctx),
            "temperature": _float(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _float(body, "top_p", 1.0, 1e-9, 1.0),
            "n": _int(body, "n", 1, 1, self.max_n),
            "seed": _int(body, "seed", None, -(2 ** 63), 2 ** 63 - 1),
            "stop": _stop(body),
            "stream": body.get("stream") is True,
            "include_usage": so.get("include_usage") is True,
            "logprobs": _logprobs_setting(body),
        }

    def _plan(self, body: dict, chat: bool):
        """The request's tool / structured-output plan (serving/tools.py), or None."""
        if not any(body.get(k) is not None for k in ("tools", "tool_choice", "response_format")):
            return None
        from .tools import ToolRequestError, plan_request

        if not chat and body.get("tools") is not None:
            raise APIError(400, "tools are only supported on /v1/chat/completions", "tools")
        try:
            return plan_request(body, self.engine.tokenizer)
        except ToolRequestError as e:
            raise APIError(400, e.message, e.param) from None

    def _prompts(self, body: dict, chat: bool, plan) -> list[list[int]]:
        """The request's prompts as token ids: one for chat; for completions one per prompt (a text, a list of
        texts, a list of token ids, or a list of token-id lists)."""
        if chat:
            return [self._prompt_ids(body, True, plan)]
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            return [self._prompt_ids({"prompt": x}, False, plan) for x in p]
        return [self._prompt_ids(body, False, plan)]

    def _prompt_ids(self, body: dict, chat: bool, plan) -> list[int]:
        tok = self.engine.tokenizer
        plain = not self.special_tokens_in_input
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
                raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
            if plan is not None:
                msgs = plan.messages
            clean = []
            for m in msgs:
                c = m.get("content")
                if isinstance(c, list):  # OpenAI content parts: keep the text parts
                    c = "".join(p["text"] for p in c if isinstance(p, dict) and p.get("type") == "text"
                                and isinstance(p.get("text"), str))
                if c is not None and not isinstance(c, str):
                    raise APIError(400, "message content must be a string or a list of text parts", "messages")
                clean.append({**{k: v for k, v in m.items() if k != "content"}, "content": c or ""})
            try:
                kwargs = plan.template_kwargs if plan is not None and plan.template_kwargs else {}
                return tok.encode_chat(clean, special_in_content=not plain, **kwargs)
            except SpecloomError as e:
                raise APIError(400, str(e), "messages") from None
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            vocab = self.engine.model.config.vocab_size
            if min(p) < 0 or max(p) >= vocab:
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            return list(p)
        if not isinstance(p, str) or not p:
            raise APIError(400, "prompt must be a non-empty string (or a list of token ids)", "prompt")
        return tok.encode(p, special=not plain)

    def _prepare(self, body: dict, chat: bool):
        """(options, prompts, plan), every field checked: the body against its pydantic model, then the ranges
        that depend on this server."""
        from .schemas import validate_body

        validate_body(body, chat)
        o = self._common(body)
        plan = self._plan(body, chat)
        prompts = self._prompts(body, chat, plan)
        if len(prompts) * o["n"] > self.max_n:
            raise APIError(400, f"{len(prompts)} prompts x n={o['n']} is {len(prompts) * o['n']} sequences; this "
                                f"server runs at most {self.max_n} at once", "prompt")
        for ids in prompts:
            if len(ids) + o["max_tokens"] > self.engine.max_model_len:
                raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {o['max_tokens']}: "
                                    f"together they exceed the model's context of {self.engine.max_model_len} tokens",
                               "max_tokens")
        return o, prompts, plan

    # -- generation ------------------------------------------------------------------------------------------
    def _submit(self, prompts: list[list[int]], o: dict, plan, callbacks=None) -> list:
        """Queue n sequences per prompt (choice index k = prompt * n + i; each its own seed: seed + i, and its
        own grammar state)."""
        from ..sampling import SamplingParams
        from ..scheduler import QueueFull, Sequence, ShuttingDown

        seqs = []
        for k in range(len(prompts) * o["n"]):
            ids, i = prompts[k // o["n"]], k % o["n"]
            constraint = None
            if plan is not None and plan.grammar is not None:
                from .grammar import compile_constraint

                constraint = compile_constraint(plan.grammar, self.engine.tokenizer, self.engine.model.config.vocab_size)
            params = SamplingParams(temperature=o["temperature"], top_p=o["top_p"],
                                    seed=None if o["seed"] is None else o["seed"] + i)
            seqs.append(Sequence(ids, o["max_tokens"], params, o["stop"], constraint=constraint,
                                 on_tokens=callbacks[k] if callbacks else None, logprobs=o["logprobs"]))
        try:
            self.scheduler.submit(seqs)
        except ShuttingDown as e:
            raise generation_error(e) from None
        except QueueFull as e:
            raise APIError(429, str(e), None, "server_busy", "rate_limit_error") from None
        except SpecloomError as e:
            raise APIError(400, str(e), "max_tokens") from None
        return seqs

    def _logprobs_json(self, chat: bool, token_ids: list[int], lps: list) -> dict:
        """OpenAI's logprobs object for these tokens: chat {content: [{token, logprob, bytes, top_logprobs}]},
        completions {tokens, token_logprobs, top_logprobs, text_offset}. Logprobs are the target's own log-softmax
        (after a grammar mask, if any) at the position each token was chosen -- the same with or without
        speculation."""
        tok = self.engine.tokenizer
        if token_ids and token_ids[-1] in tok.eos_token_ids:  # the end-of-turn token is not part of the text
            token_ids, lps = token_ids[:-1], lps[:len(token_ids) - 1]

        def s(t):
            return tok.decode([t], skip_special_tokens=False)

        if chat:
            return {"content": [{"token": s(t), "logprob": lp, "bytes": list(s(t).encode()),
                                 "top_logprobs": [{"token": s(a), "logprob": alp, "bytes": list(s(a).encode())}
                                                  for a, alp in alts]} for t, (lp, alts) in zip(token_ids, lps)],
                    "refusal": None}
        offsets, pos = [], 0
        for t in token_ids:
            offsets.append(pos)
            pos += len(s(t))
        return {"tokens": [s(t) for t in token_ids], "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{s(a): alp for a, alp in alts} for _, alts in lps], "text_offset": offsets}

    def _finished(self, seq) -> None:
        r = seq.result
        if r is not None:
            ttft = None if seq.t_first is None else seq.t_first - seq.t_submit
            self.metrics.record(r, time.perf_counter() - seq.t_submit, ttft)

    def _message(self, plan, text: str, chat: bool) -> tuple[dict, bool]:
        """(message or text fields, has tool calls) for a finished choice."""
        if not chat:
            return {"text": text}, False
        if plan is not None and plan.parser is not None:
            parsed = _new_parser(plan.parser).feed(text, final=True)
            calls = [_tool_call_json(c, j) for j, c in enumerate(parsed.tool_calls)]
            msg = {"role": "assistant", "content": parsed.content or None}
            if calls:
                msg["tool_calls"] = calls
            else:
                msg["content"] = parsed.content
            return {"message": msg}, bool(calls)
        return {"message": {"role": "assistant", "content": text}}, False

    def complete(self, body: dict, chat: bool, gone: threading.Event | None = None) -> dict:
        """A non-streamed response. `gone` set (the client disconnected): cancel the request's sequences."""
        o, prompts, plan = self._prepare(body, chat)
        seqs = self._submit(prompts, o, plan)
        while gone is not None and not all(s.done.wait(0.2) for s in seqs):
            if gone.is_set():
                for s in seqs:
                    s.cancel()
                self.metrics.abort()
                raise APIError(499, "the client closed the request", None, "client_closed")
        choices, completion = [], 0
        for i, seq in enumerate(seqs):
            try:
                r = seq.wait()
            except Exception as e:
                raise generation_error(e) from None
            self._finished(seq)
            completion += len(r.token_ids)
            fields, called = self._message(plan, r.text, chat)
            finish = "tool_calls" if called else ("length" if r.finish_reason == "length" else "stop")
            lps = None if r.logprobs is None else self._logprobs_json(chat, r.token_ids, r.logprobs)
            choices.append({"index": i, **fields, "finish_reason": finish, "logprobs": lps})
        return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "object":
                "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": completion,
                          "total_tokens": sum(map(len, prompts)) + completion}}

    async def stream(self, body: dict, chat: bool, is_disconnected):
        """Yields SSE lines. Parsing, validation and admission happen before the first byte (errors stay HTTP
        errors, a full queue is a 429)."""
        o, prompts, plan = self._prepare(body, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        n = len(prompts) * o["n"]  # choices
        detoks = [IncrementalDetokenizer(self.engine.tokenizer) for _ in range(n)]
        holds = [_StopHold(o["stop"]) for _ in range(n)]
        parsers = [_new_parser(plan.parser) if chat and plan is not None and plan.parser else None for _ in range(n)]

        def make_cb(i):
            def on_tokens(new, lps=None):
                text = holds[i].push(detoks[i].push(new))
                if lps is not None:  # a chunk per step: its text (maybe held back: "") and its tokens' logprobs
                    loop.call_soon_threadsafe(q.put_nowait, (i, "text", (text, self._logprobs_json(chat, new, lps))))
                elif text:
                    loop.call_soon_threadsafe(q.put_nowait, (i, "text", (text, None)))
                return True
            return on_tokens

        seqs = self._submit(prompts, o, plan, [make_cb(i) for i in range(n)])
        for i, seq in enumerate(seqs):
            def waiter(i=i, seq=seq):
                seq.done.wait()
                loop.call_soon_threadsafe(q.put_nowait, (i, "done", seq))
            threading.Thread(target=waiter, daemon=True).start()

        def chunk(i, text=None, finish=None, role=False, tool_calls=None, logprobs=None):
            if chat:
                if role:
                    delta = {"role": "assistant", "content": ""}
                elif tool_calls:
                    delta = {"tool_calls": tool_calls}
                else:
                    delta = {"content": text} if text else {}
                ch = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                ch = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                          "choices": [ch]}, ensure_ascii=False) + "\n\n"

        def parsed_chunks(i, parsed, called):
            out = []
            if parsed.content:
                out.append(chunk(i, text=parsed.content))
            for c in parsed.tool_calls:
                out.append(chunk(i, tool_calls=[_tool_call_json(c, called[i], stream=True)]))
                called[i] += 1
            return out

        async def gen():
            completion, left = 0, n
            called = [0] * n
            try:
                if chat:
                    for i in range(n):
                        yield chunk(i, role=True)
                while left:
                    try:
                        i, kind, val = await asyncio.wait_for(q.get(), 0.5)
                    except asyncio.TimeoutError:
                        if await is_disconnected():
                            return
                        continue
                    if kind == "text":
                        val, lps = val
                        if parsers[i] is not None:
                            for line in parsed_chunks(i, parsers[i].feed(val), called):
                                yield line
                        else:
                            yield chunk(i, text=val, logprobs=lps)
                        continue
                    left -= 1
                    seq = val
                    if seq.error is not None or seq.result is None:
                        err = generation_error(seq.error if seq.error is not None else RuntimeError("no result"))
                        yield "data: " + json.dumps(err.body(), ensure_ascii=False) + "\n\n"
                        return
                    self._finished(seq)
                    tail = holds[i].push(detoks[i].finish(), final=True)
                    if parsers[i] is not None:
                        lines = parsed_chunks(i, parsers[i].feed(tail, final=True), called)
                    else:
                        lines = [chunk(i, text=tail)] if tail else []
                    for line in lines:
                        yield line
                    completion += len(seq.result.token_ids)
                    r = seq.result
                    yield chunk(i, finish="tool_calls" if called[i] else ("length" if r.finish_reason == "length"
                                                                          else "stop"))
                if o["include_usage"]:
                    used = sum(map(len, prompts))
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                 "model": self.model_name, "choices": [],
                                                 "usage": {"prompt_tokens": used, "completion_tokens": completion,
                                                           "total_tokens": used + completion}}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): stop and free whatever still runs
                running = [seq for seq in seqs if not seq.done.is_set()]
                for seq in running:
                    seq.cancel()
                if running:
                    self.metrics.abort()

        return gen()


def _logprobs_setting(body: dict) -> int | None:
    """None (no logprobs) or how many alternatives per token: chat `logprobs: true` + `top_logprobs` (0-20),
    completions `logprobs: N` (0-5), as OpenAI."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if isinstance(lp, bool) or lp is None:
        if top is not None and not lp:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not lp:
            return None
        return _int(body, "top_logprobs", 0, 0, 20)
    if isinstance(lp, int) and 0 <= lp <= 5:
        return lp
    raise APIError(400, f"logprobs must be true/false (chat) or an integer in [0, 5] (completions), got {lp!r}",
                   "logprobs")


def _new_parser(name: str):
    from .parsers import HermesToolParser, Llama3JsonToolParser

    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}[name]()


def _tool_call_json(call, index: int, stream: bool = False) -> dict:
    d = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **d} if stream else d


def bearer_ok(header: str, key: str) -> bool:
    """`Authorization: Bearer KEY` (the scheme in any case, as RFC 7235 has it), the key compared in constant
    time."""
    scheme, _, given = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def build_app(target):
    """The FastAPI app over a `Server`, or over a `Lifecycle` (serving/lifecycle.py) whose server comes when the
    model is loaded: until then `/health` answers 503 "starting"."""
    from fastapi import FastAPI
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, StreamingResponse

    from .lifecycle import Lifecycle
    from .request_body import closes_connection, parse_json, read_body
    from .schemas import ChatCompletionRequest, CompletionRequest, openapi_body, openapi_components

    life = target if isinstance(target, Lifecycle) else Lifecycle(target)
    app = FastAPI(title="specloom")

    def error(e: APIError):
        if life.server is not None:
            life.server.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status,
                            headers={"Connection": "close"} if closes_connection(e) else None)

    def denied(request: Request, generation: bool = False):
        """The 503 while starting (or, for generation, draining), else the 401 when an API key is set and the
        request does not carry it (checked in each /v1 handler: an HTTP middleware would wrap `receive` and hide
        client disconnects from the handlers)."""
        if (refused := life.refusal(generation)) is not None:
            return error(refused)
        server = life.server
        if server.api_key and not bearer_ok(request.headers.get("authorization", ""), server.api_key):
            return error(APIError(401, "Incorrect API key provided", None, "invalid_api_key", "authentication_error"))
        return None

    def model_card() -> dict:
        server = life.server
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "specloom"}

    @app.get("/health")
    async def health():
        status = "ok" if life.state == "ready" else life.state
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        from fastapi.responses import PlainTextResponse

        if life.server is None or life.server.metrics_require_key:
            if (resp := denied(request)) is not None:
                return resp
        return PlainTextResponse(life.server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        if (resp := denied(request)) is not None:
            return resp
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        if (resp := denied(request)) is not None:
            return resp
        server = life.server
        if model_id != server.model_name:
            return error(APIError(404, f"The model {model_id!r} does not exist (this server serves "
                                       f"{server.model_name!r})", "model", "model_not_found"))
        return model_card()

    async def handle(request: Request, chat: bool):
        if (resp := denied(request, generation=True)) is not None:
            return resp
        server = life.server
        try:
            raw = await read_body(request, server.max_body_bytes)
            body = parse_json(raw) if len(raw) < 2 ** 16 else await asyncio.to_thread(parse_json, raw)
            if body.get("stream") is True:
                gen = await server.stream(body, chat, request.is_disconnected)
                return StreamingResponse(gen, media_type="text/event-stream")
            gone = threading.Event()
            task = asyncio.ensure_future(asyncio.to_thread(server.complete, body, chat, gone))
            while not task.done():  # watch for the client going away while the sequences run
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    gone.set()
            return JSONResponse(task.result())
        except APIError as e:
            return error(e)
        except Exception:  # a bug, not the client's fault: one clear 500 body, the traceback in the log only
            log.exception("request failed")
            return error(APIError(500, "internal error while handling the request (see the server log)", None,
                                  "internal_error", "server_error"))

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await handle(request, False)

    def openapi():  # FastAPI's document plus the request models the routes refer to
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return app
