"""The HTTP app: FastAPI routes over a `Server` (serving/api.py) or a `Lifecycle` (serving/lifecycle.py).

Endpoints: `GET /health` (200 "ok" when ready, 503 "starting" / "draining" otherwise), `GET /v1/models`,
`GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions`, `GET /metrics` (Prometheus). Every body
is read under a size and nesting limit (serving/request_body.py) before anything else. Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`; the API key (when set) is checked on every `/v1` route (and on
`/metrics` when the server is told to), in constant time. A client that disconnects cancels its sequences."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading

from fastapi import Request  # module level: FastAPI resolves the handlers' (postponed) annotations here

from .http_errors import APIError

log = logging.getLogger("specloom.serve")


def _page() -> str:
    import os

    with open(os.path.join(os.path.dirname(__file__), "static", "chat.html"), encoding="utf-8") as f:
        return f.read()


def bearer_ok(header: str, key: str) -> bool:
    """`Authorization: Bearer KEY` as RFC 7235 and 6750 write it: the scheme in any case, one or more spaces
    (1*SP), then the token and nothing else (no tab, no inner or trailing space); compared in constant time."""
    scheme, _, rest = header.partition(" ")
    given = rest.lstrip(" ")
    ok = scheme.lower() == "bearer" and given != "" and not any(c.isspace() for c in given)
    return hmac.compare_digest(given.encode(), key.encode()) and ok


def build_app(target):
    """The FastAPI app over a `Server`, or over a `Lifecycle` (serving/lifecycle.py) whose server comes when the
    model is loaded: until then `/health` answers 503 "starting"."""
    from fastapi import FastAPI
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, StreamingResponse

    from .lifecycle import Lifecycle
    from .request_body import LARGE_BODY_BYTES, closes_connection, parse_json, read_body, release_memory
    from .schemas import ChatCompletionRequest, CompletionRequest, openapi_body, openapi_components

    life = target if isinstance(target, Lifecycle) else Lifecycle(target)
    # the docs routes are ours (below): behind the API key like every other route that describes the server
    app = FastAPI(title="specloom", docs_url=None, redoc_url=None, openapi_url=None)

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

    @app.get("/", include_in_schema=False)
    async def page():
        """The chat page (serving/static/chat.html: no build step, no CDN): streams an answer and colours each
        token by how it came. The page itself holds nothing secret; the API calls it makes carry the key the user
        types (the same key rules as any client)."""
        from fastapi.responses import HTMLResponse

        return HTMLResponse(_page())

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
        raw = b""
        try:
            raw = await read_body(request, server.max_body_bytes)
            body = parse_json(raw) if len(raw) < 2 ** 16 else await asyncio.to_thread(parse_json, raw)
            if body.get("stream") is True:
                gen = server.stream(body, chat, request.is_disconnected)
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
        finally:
            if len(raw) >= LARGE_BODY_BYTES:  # parsed and tokenized: hand the freed pages back
                raw = body = None  # noqa: F841  (the request's last references, before the trim)
                await asyncio.to_thread(release_memory)

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

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(request: Request):
        if (resp := denied(request)) is not None:
            return resp
        return JSONResponse(openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        from fastapi.openapi.docs import get_swagger_ui_html

        if (resp := denied(request)) is not None:
            return resp
        return get_swagger_ui_html(openapi_url="/openapi.json", title="specloom")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        from fastapi.openapi.docs import get_redoc_html

        if (resp := denied(request)) is not None:
            return resp
        return get_redoc_html(openapi_url="/openapi.json", title="specloom")

    return app
