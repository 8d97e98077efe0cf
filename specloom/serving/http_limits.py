"""What a connection may hold of the server before it sends a request: uvicorn's h11 protocol closes idle
keep-alive connections after a response, but a connection that never completes a request head (an idle socket,
a slowloris sending one header byte at a time) stays open forever. `HeadTimeoutProtocol` gives every connection
`head_timeout` seconds from its start (and from the end of each response) to deliver a complete request head,
then closes it; `config` builds the uvicorn configuration with it and a cap on concurrent connections
(`limit_concurrency`: beyond it uvicorn answers 503 at once)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT = 10.0  # seconds a connection gets to send a complete request head
MAX_CONNECTIONS = 512  # concurrent connections (and requests) before uvicorn answers 503


class HeadTimeoutProtocol(H11Protocol):
    head_timeout = HEAD_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:  # no request under way: close the connection
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a request head arrived: the request's own life takes over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._disarm()
            self._arm()  # the next request's head gets the same time (the keep-alive timeout applies too)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def config(app, head_timeout: float = HEAD_TIMEOUT, max_connections: int = MAX_CONNECTIONS, **kw):
    """uvicorn.Config for `app` with the head timeout and the connection cap (other keywords: uvicorn's)."""
    import uvicorn

    protocol = type("HeadTimeout", (HeadTimeoutProtocol,), {"head_timeout": head_timeout})
    return uvicorn.Config(app, http=protocol, limit_concurrency=max_connections, timeout_keep_alive=5, **kw)
