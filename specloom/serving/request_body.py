"""Reading a request body safely, before any field is looked at: a size limit (413), a nesting-depth limit checked
on the raw bytes before parsing (so `[[[[...` 100k deep is a 400, not a RecursionError), JSON parsing whose every
failure is a 400 (invalid UTF-8, huge integers past Python's int-conversion limit), and no lone surrogates
(`"\\ud800"` parses to a str no tokenizer can take)."""

from __future__ import annotations

import asyncio
import json

from .http_errors import APIError

MAX_BODY_BYTES = 16 * 2 ** 20
LARGE_BODY_BYTES = 2 ** 20  # after a body this big, freed heap pages go back to the OS (`release_memory`)
MAX_DEPTH = 64

_KEEP = b'"[]{}'
_DROP = bytes(b for b in range(256) if b not in _KEEP)


async def read_body(request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, refused with 413 once it passes `max_bytes`: by Content-Length before anything is read, or --
    a chunked upload has none -- as soon as the chunks read so far pass it (at most `max_bytes` plus one chunk is
    ever held). The 413 closes the connection (`closes_connection`), so the rest of an oversized upload is never
    read. A client that hangs up mid-body is a 499, not a server error. A refused or abandoned upload past
    `LARGE_BODY_BYTES` hands its pieces' heap pages back (`release_memory`) as it leaves."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is {int(declared)} bytes, more than the limit of {max_bytes}",
                       None, "request_too_large")
    chunks, size, whole = [], 0, False
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"the request body is more than the limit of {max_bytes} bytes", None,
                               "request_too_large")
            chunks.append(chunk)
        whole = True
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection before the request body ended", None,
                       "client_closed") from None
    finally:
        if not whole and size >= LARGE_BODY_BYTES:  # a refused or abandoned large upload: its pieces' pages back
            chunks.clear()
            await asyncio.to_thread(release_memory)
    return b"".join(chunks)


def closes_connection(e: APIError) -> bool:
    """Whether the response to `e` must close the connection: after a 413 the unread rest of the body would
    otherwise be read (and thrown away) to keep the connection alive -- all of an endless chunked upload."""
    return e.status == 413


def too_deep(raw: bytes, max_depth: int) -> bool:
    """Whether JSON text nests arrays and objects more than `max_depth` levels (brackets inside strings do not
    count). C-speed byte operations only: escapes go first (left to right, as a JSON scanner reads them), then
    everything but quotes and brackets, then the strings; each round then peels one level of `[]` / `{}`."""
    skeleton = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)
    s = b"".join(skeleton.split(b'"')[::2])  # outside the strings (an unclosed one: the parser refuses it)
    for _ in range(max_depth):
        peeled = s.replace(b"[]", b"").replace(b"{}", b"")
        if peeled == s:  # all peeled, or unbalanced text the parser will refuse
            return False
        s = peeled
    return bool(s) and (b"[]" in s or b"{}" in s)


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> dict:
    """The body as a JSON object, or an APIError(400) saying why not."""
    if too_deep(raw, max_depth):
        raise APIError(400, f"the request body nests arrays and objects more than {max_depth} levels deep")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays and objects too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers longer than Python's int-conversion limit
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_strings(body, "")
    return body


def _check_strings(v, where: str) -> None:
    """Every string (keys included) must be encodable as UTF-8: JSON's `\\ud800` escapes can make lone
    surrogates, which the tokenizer rejects."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{where or 'the body'}: the string holds a lone UTF-16 surrogate "
                                "(an unpaired \\ud800-\\udfff escape), which is not valid Unicode text",
                           where or None) from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_strings(k, where)
            _check_strings(x, f"{where}.{k}" if where else k)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_strings(x, f"{where}[{i}]")


_libc: list = []


def release_memory() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere). Parsing and tokenizing a body
    of megabytes allocates many times its size; once freed, glibc keeps those pages for reuse, so a few refused
    large bodies would otherwise leave the server's resident set gigabytes higher for good."""
    if not _libc:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.append(getattr(lib, "malloc_trim", None))
        except OSError:
            _libc.append(None)
    if _libc[0] is not None:
        _libc[0](0)
