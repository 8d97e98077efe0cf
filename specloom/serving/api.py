"""OpenAI-compatible HTTP API over one `Engine` (issue 6, first part).

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming
with `stream_options.include_usage`, `n`, `stop`, `seed`, `temperature`, `top_p`, `max_tokens`). Errors use
OpenAI's body `{"error": {"message", "type", "param", "code"}}` with 400 / 401 / 404; the API key (when set) is
checked on every `/v1` route. `/metrics`: Prometheus counters and latency histograms (serving/metrics.py). Streaming runs the engine's per-step callback through the incremental detokenizer,
so deltas stay exact when a speculative step emits several tokens; stop strings are held back until they are
decided. A client that disconnects stops its generation at the next step.

Not yet (issue 6 continues): continuous batching (requests run one at a time, in arrival order, behind a lock),
the memory budget and 429 admission, load-aware speculation, tool calling and structured output.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid

from fastapi import Request  # module level: FastAPI resolves the handlers' (postponed) annotations here

from ..errors import SpecloomError
from .detokenize import IncrementalDetokenizer


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


class Server:
    def __init__(self, engine, model_name: str, api_key: str | None = None, max_num_seqs: int = 8):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.lock = threading.Lock()  # the engine runs one request at a time (continuous batching: later)
        self.max_n = max_num_seqs
        self.created = int(time.time())
        from .metrics import Metrics

        self.metrics = Metrics(model_name)

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
            "stream": bool(body.get("stream", False)),
            "include_usage": bool(so.get("include_usage", False)),
        }

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        tok = self.engine.tokenizer
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
                raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
            clean = []
            for m in msgs:
                c = m.get("content")
                if isinstance(c, list):  # OpenAI content parts: keep the text parts
                    c = "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
                if c is not None and not isinstance(c, str):
                    raise APIError(400, "message content must be a string or a list of text parts", "messages")
                clean.append({"role": m["role"], "content": c or ""})
            try:
                return tok.encode_chat(clean)
            except SpecloomError as e:
                raise APIError(400, str(e), "messages") from None
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            return list(p)
        if not isinstance(p, str) or not p:
            raise APIError(400, "prompt must be a non-empty string (or a list of token ids)", "prompt")
        return tok.encode(p)

    # -- generation ------------------------------------------------------------------------------------------
    def _generate(self, ids: list[int], o: dict, i: int, on_tokens=None):
        seed = None if o["seed"] is None else o["seed"] + i
        t0 = time.perf_counter()
        first: list[float] = []

        def timed(new):
            if not first:
                first.append(time.perf_counter() - t0)
            return True if on_tokens is None else on_tokens(new)

        try:
            with self.lock:
                r = self.engine.generate(prompt_token_ids=ids, max_tokens=o["max_tokens"],
                                         temperature=o["temperature"], top_p=o["top_p"], seed=seed,
                                         stop=o["stop"], on_tokens=timed)
        except SpecloomError as e:
            raise APIError(400, str(e), "messages" if "prompt" in str(e) else None) from None
        self.metrics.record(r, time.perf_counter() - t0, first[0] if first else None)
        return r

    def complete(self, body: dict, chat: bool) -> dict:
        o = self._common(body)
        ids = self._prompt_ids(body, chat)
        choices, completion = [], 0
        for i in range(o["n"]):
            r = self._generate(ids, o, i)
            completion += len(r.token_ids)
            finish = "stop" if r.finish_reason in ("stop", "abort") else "length"
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": r.text},
                                "finish_reason": finish, "logprobs": None})
            else:
                choices.append({"index": i, "text": r.text, "finish_reason": finish, "logprobs": None})
        return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "object":
                "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                          "total_tokens": len(ids) + completion}}

    async def stream(self, body: dict, chat: bool, is_disconnected):
        """Yields SSE lines. Parsing and validation happen before the first byte (errors stay HTTP errors)."""
        o = self._common(body)
        ids = self._prompt_ids(body, chat)
        if len(ids) + o["max_tokens"] > self.engine.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {o['max_tokens']}: together "
                                f"they exceed the model's context of {self.engine.max_model_len} tokens", "max_tokens")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, text=None, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                ch = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                ch = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                          "choices": [ch]}, ensure_ascii=False) + "\n\n"

        async def gen():
            completion = 0
            for i in range(o["n"]):
                q: queue.Queue = queue.Queue()
                cancel = threading.Event()
                detok = IncrementalDetokenizer(self.engine.tokenizer)
                hold = _StopHold(o["stop"])

                def on_tokens(new, detok=detok, hold=hold, q=q, cancel=cancel):
                    text = hold.push(detok.push(new))
                    if text:
                        q.put(("text", text))
                    return not cancel.is_set()

                def work(i=i, q=q, on_tokens=on_tokens, detok=detok, hold=hold):
                    try:
                        r = self._generate(ids, o, i, on_tokens)
                        tail = hold.push(detok.finish(), final=True)
                        if tail:
                            q.put(("text", tail))
                        q.put(("done", r))
                    except Exception as e:  # reported in-band: the HTTP status is already sent
                        q.put(("error", e))

                threading.Thread(target=work, daemon=True).start()
                if chat:
                    yield chunk(i, role=True)
                while True:
                    try:
                        kind, val = await asyncio.to_thread(q.get, True, 0.5)
                    except queue.Empty:
                        if await is_disconnected():
                            cancel.set()
                            return
                        continue
                    if kind == "text":
                        yield chunk(i, text=val)
                    elif kind == "error":
                        msg = val.message if isinstance(val, APIError) else str(val)
                        yield "data: " + json.dumps({"error": {"message": msg, "type": "server_error"}}) + "\n\n"
                        return
                    else:
                        completion += len(val.token_ids)
                        yield chunk(i, finish="length" if val.finish_reason == "length" else "stop")
                        break
            if o["include_usage"]:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                             "choices": [], "usage": {"prompt_tokens": len(ids),
                                                                      "completion_tokens": completion,
                                                                      "total_tokens": len(ids) + completion}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return gen()


def build_app(server: Server):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="specloom")

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {server.api_key}":
                return error(APIError(401, "Incorrect API key provided", None, "invalid_api_key",
                                      "authentication_error"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "specloom"}]}

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(APIError(400, f"the request body is not valid JSON: {e}"))
        if not isinstance(body, dict):
            return error(APIError(400, "the request body must be a JSON object"))
        try:
            if body.get("stream"):
                gen = await server.stream(body, chat, request.is_disconnected)
                return StreamingResponse(gen, media_type="text/event-stream")
            return JSONResponse(await asyncio.to_thread(server.complete, body, chat))
        except APIError as e:
            return error(e)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    return app
