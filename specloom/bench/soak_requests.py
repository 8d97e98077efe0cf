"""The requests of the soak test (bench/soak.py), one function per kind, each returning one outcome record:
`{"kind", "prompt", "status", "ok", "problem", "answered", "completed"}` (`problem` None when ok).

- `valid` / `stream`: a greedy chat completion of one of the soak's prompts, non-streamed or streamed (the official
  `openai` client; the streamed one through bench-serve's `_one`); ok when the text equals the prompt's alone text.
- `disconnect`: the same request, abandoned: a stream closed after a few content chunks, or a non-streamed request
  whose socket is closed after a short timeout; ok when what arrived is a prefix of the alone text.
- `malformed`: bodies no server should take (bad JSON, wrong types, 100k-deep nesting, a 5,000-digit integer, a
  lone surrogate, invalid UTF-8, a Content-Length of a terabyte, a chunked upload past the body limit); ok on a 4xx.
- `poisoned`: well-formed requests that must be refused when planned (a forced tool call or a response_format whose
  schema's required property is a `$ref` to itself, a prompt longer than the context); ok on a 4xx.
"""

from __future__ import annotations

import http.client
import json
import socket

SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
            "$defs": {"A": {"$ref": "#/$defs/A"}}}
CHAT_PATH = "/v1/chat/completions"


def _chat(model: str, content, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def malformed_bodies(model: str) -> list[tuple[str, bytes]]:
    ok = json.dumps(_chat(model, "hi", max_tokens=4))
    return [
        ("truncated_json", ok[:-7].encode()),
        ("messages_not_list", json.dumps({"model": model, "messages": "hi", "max_tokens": 4}).encode()),
        ("max_tokens_string", json.dumps(_chat(model, "hi", max_tokens="ten")).encode()),
        ("temperature_list", json.dumps(_chat(model, "hi", max_tokens=4, temperature=[1])).encode()),
        ("stream_string", json.dumps(_chat(model, "hi", max_tokens=4, stream="no")).encode()),
        ("role_not_string", json.dumps({"model": model, "messages": [{"role": 5, "content": "x"}]}).encode()),
        ("text_part_null", json.dumps(_chat(model, [{"type": "text", "text": None}], max_tokens=4)).encode()),
        ("empty_messages", json.dumps({"model": model, "messages": []}).encode()),
        ("deep_nesting", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("huge_integer", ok[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}"),
        ("lone_surrogate", json.dumps(_chat(model, "LONE", max_tokens=4)).replace("LONE", "a\\ud800").encode()),
        ("invalid_utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ("not_an_object", b"[1, 2, 3]"),
    ]


def poisoned_bodies(model: str, max_model_len: int) -> list[tuple[str, dict]]:
    tool = {"type": "function", "function": {"name": "f", "parameters": SELF_REF}}
    forced = _chat(model, "call it", max_tokens=16, temperature=0, tools=[tool], tool_choice="required")
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SELF_REF}}
    return [
        ("self_ref_tool", forced),
        ("self_ref_tool_stream", {**forced, "stream": True}),
        ("self_ref_response_format", _chat(model, "json", max_tokens=16, temperature=0, response_format=fmt)),
        ("prompt_too_long", _chat(model, "hello " * (2 * max_model_len), max_tokens=4, temperature=0)),
    ]


def _post_raw(port: int, data: bytes, timeout: float, headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of a raw POST over a fresh connection (closed on return)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", CHAT_PATH, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def raw_exchange(port: int, head: bytes, body_chunks, timeout: float) -> tuple[int | None, bytes, int, bool]:
    """Sends `head` then the body chunks, stopping when the server closes, while a second thread reads the answer.
    Returns (the status answered, or None; the answer's bytes; body bytes sent; whether the server closed the
    connection)."""
    import threading

    got, closed = bytearray(), threading.Event()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        def read():
            try:
                while chunk := s.recv(65536):
                    got.extend(chunk)
                closed.set()
            except ConnectionResetError:
                closed.set()
            except OSError:  # timeout, or the socket closed under it
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        sent = 0
        try:
            s.sendall(head)
            for c in body_chunks:
                if closed.is_set():
                    break
                s.sendall(c)
                sent += len(c)
        except (BrokenPipeError, ConnectionResetError):
            closed.set()  # the server answered and closed before the body ended: what it should do
        reader.join(timeout)
    parts = bytes(got).split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None), bytes(got), sent, closed.is_set()


def _oversized(port: int, kind: str, timeout: float) -> tuple[int | None, bytes]:
    """(status, body) of a body past the server's limit: declared by Content-Length, or chunked without one."""
    head = (f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n").encode()
    if kind == "content_length_terabyte":
        status, reply, _, _ = raw_exchange(port, head + b"Content-Length: 1000000000000\r\n\r\n",
                                           [b'{"messages": ['], timeout)
    else:  # 64 KiB chunks until the server refuses (its default limit is 16 MiB; 64 MiB at most)
        piece = b"%x\r\n" % 65536 + b" " * 65536 + b"\r\n"
        status, reply, _, _ = raw_exchange(port, head + b"Transfer-Encoding: chunked\r\n\r\n",
                                           (piece for _ in range(1024)), timeout)
    return status, reply.partition(b"\r\n\r\n")[2]


def _refused(status, body: bytes = b"{}") -> str | None:
    """The problem with a bad request's answer, or None for a 4xx."""
    if status is None:
        return "no_answer"
    if status >= 500:
        return "5xx"
    if status < 400:
        return "accepted"
    try:
        return None if "error" in json.loads(body) else "4xx_without_error_body"
    except ValueError:
        return "4xx_without_error_body"


class Requests:
    """Sends one request of each kind. `alone[i]` is prompt i's alone text."""

    def __init__(self, port: int, model: str, prompts: list[str], alone: list[str], max_tokens: int,
                 max_model_len: int, timeout: float = 600.0):
        import openai

        self.port, self.model, self.prompts, self.alone, self.max_tokens = port, model, prompts, alone, max_tokens
        self.timeout = timeout
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    timeout=timeout)
        self.malformed = malformed_bodies(model) + [("content_length_terabyte", b""), ("chunked_past_limit", b"")]
        self.poisoned = poisoned_bodies(model, max_model_len)

    def greedy_body(self, i: int, stream: bool = False) -> dict:
        return _chat(self.model, self.prompts[i], max_tokens=self.max_tokens, temperature=0, stream=stream)

    def _judge(self, kind: str, i: int, text: str | None, status, error: str | None, abandoned: bool = False):
        """The record of a greedy request. Answered (the whole response arrived): ok when its text is the alone
        text. Abandoned by its client: ok when what arrived is a prefix of it."""
        answered = error is None and not abandoned
        if error is not None:
            problem = error
        elif text == self.alone[i] or (abandoned and self.alone[i].startswith(text)):
            problem = None
        else:
            problem = "truncated" if self.alone[i].startswith(text) else "corrupted"
        return {"kind": kind, "prompt": i, "status": status, "ok": problem is None, "problem": problem,
                "answered": answered, "completed": answered and text == self.alone[i]}

    @staticmethod
    def _openai_error(e) -> tuple[int | None, str]:
        import openai

        status = getattr(e, "status_code", None)
        if status is not None:
            return status, "5xx" if status >= 500 else f"refused_{status}"
        if isinstance(e, openai.APIConnectionError):  # includes timeouts
            return None, "lost"
        return None, "error_event"  # an error event in the stream

    def valid(self, rng) -> dict:
        i = rng.randrange(len(self.prompts))
        try:
            r = self.client.chat.completions.create(**self.greedy_body(i))
            return self._judge("valid", i, r.choices[0].message.content or "", 200, None)
        except Exception as e:
            status, problem = self._openai_error(e)
            return self._judge("valid", i, None, status, problem)

    def stream(self, rng) -> dict:
        from .serve_load import _one

        i = rng.randrange(len(self.prompts))
        try:
            r = _one(self.client, self.model, self.prompts[i], self.max_tokens)
            return self._judge("stream", i, r["text"], 200, None)
        except Exception as e:
            status, problem = self._openai_error(e)
            return self._judge("stream", i, None, status, problem)

    def disconnect(self, rng) -> dict:
        i = rng.randrange(len(self.prompts))
        if rng.random() < 0.5:  # a stream closed after a few content chunks
            text, want = [], rng.randint(1, 8)
            try:
                s = self.client.chat.completions.create(**self.greedy_body(i, stream=True))
                for ch in s:
                    if ch.choices and ch.choices[0].delta.content:
                        text.append(ch.choices[0].delta.content)
                        if len(text) >= want:
                            s.close()
                            return self._judge("disconnect", i, "".join(text), 200, None, abandoned=True)
                return self._judge("disconnect", i, "".join(text), 200, None)  # it ended first: answered
            except Exception as e:
                status, problem = self._openai_error(e)
                return self._judge("disconnect", i, None, status, problem)
        try:  # a non-streamed request whose client gives up after a short wait
            status, body = _post_raw(self.port, json.dumps(self.greedy_body(i)).encode(), rng.uniform(0.05, 0.5))
        except TimeoutError:
            return self._judge("disconnect", i, "", None, None, abandoned=True)
        except OSError:
            return self._judge("disconnect", i, None, None, "lost")
        if status != 200:
            return self._judge("disconnect", i, None, status, "5xx" if status >= 500 else f"refused_{status}")
        return self._judge("disconnect", i, json.loads(body)["choices"][0]["message"]["content"] or "", status, None)

    def bad(self, kind: str, rng) -> dict:
        return self.send_bad(kind, *rng.choice(self.malformed if kind == "malformed" else self.poisoned))

    def send_bad(self, kind: str, name: str, data) -> dict:
        try:
            if name in ("content_length_terabyte", "chunked_past_limit"):
                status, body = _oversized(self.port, name, 60.0)
            else:
                raw = data if isinstance(data, bytes) else json.dumps(data).encode()
                status, body = _post_raw(self.port, raw, self.timeout)
            problem = _refused(status, body)
        except OSError:
            status, problem = None, "lost"
        return {"kind": kind, "prompt": None, "case": name, "status": status, "ok": problem is None,
                "problem": problem, "answered": False, "completed": False}
