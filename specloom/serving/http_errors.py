"""The error every request handler raises: an HTTP status and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def generation_error(error: BaseException) -> APIError:
    """What the client of a sequence that failed while generating is told: a SpecloomError is the request's own
    fault (its grammar cannot continue, say): 400 with its message; the server shutting down before it finished:
    503; anything else is ours: 500, the details in the server log only."""
    from ..errors import SpecloomError
    from ..scheduler import ShuttingDown

    if isinstance(error, ShuttingDown):
        return APIError(503, str(error), None, "server_shutting_down", "server_error")
    if isinstance(error, SpecloomError):
        return APIError(400, str(error))
    return APIError(500, "generating this response failed (an internal error; see the server log)", None,
                    "generation_failed", "server_error")
