"""The server's life, as its HTTP routes see it: starting (the socket is open, the model loads and the verify-cost
curve is measured) -> ready -> draining (after SIGTERM: no new request is admitted, the accepted ones finish within
the grace period) -> the process exits.

`/health` is the readiness probe (as vLLM's and SGLang's are): 200 `{"status": "ok"}` only when ready, otherwise 503
with `{"status": "starting"}` or `{"status": "draining"}`. Generation routes answer 503 (OpenAI's error body, code
`server_starting` / `server_shutting_down`) outside ready; the other `/v1` routes only while starting (there is no
model yet)."""

from __future__ import annotations

from .http_errors import APIError


class Lifecycle:
    def __init__(self, server=None):
        self.server = server  # the Server, once the model is loaded
        self.state = "ready" if server is not None else "starting"

    def ready(self, server) -> None:
        self.server = server
        self.state = "ready"

    def drain(self, timeout: float) -> None:
        """Stop admitting; the scheduler finishes what it accepted within `timeout` seconds (scheduler.py)."""
        self.state = "draining"
        if self.server is not None:
            self.server.scheduler.drain(timeout)

    def refusal(self, generation: bool) -> APIError | None:
        """The 503 for a request this state cannot take, or None."""
        if self.state == "starting":
            return APIError(503, "the server is starting (the model is loading); retry when /health answers ok",
                            None, "server_starting", "server_error")
        if self.state == "draining" and generation:
            return APIError(503, "the server is shutting down and admits no new request", None,
                            "server_shutting_down", "server_error")
        return None
