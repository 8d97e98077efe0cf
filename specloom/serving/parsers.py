"""Streaming parsers for model output: reasoning blocks and tool calls, independent of how the text is cut.

Peers' streaming parsers assume one token per step and drop or merge characters when a step emits several tokens
(a tag split across deltas, two tags in one delta). These parsers work on text, not tokens: each `feed(delta)`
returns events for the text that is *settled* -- text that cannot be the start of a tag is released at once, a
possible tag prefix is held back until the next delta decides it. `finish()` settles the rest. So the final
(content, reasoning, tool calls) are the same for every split of the text into deltas, including the whole text
in one piece (the non-streamed parse) -- property-tested in tests/test_streaming_parsers.py.

* `ReasoningParser`: `<think> ... </think>` (DeepSeek-R1 / Qwen3 style) -> reasoning_content, the rest content.
* `HermesToolParser`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5/3), any number
  of calls between content.
* `Llama3JsonToolParser`: the whole answer is one JSON object `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), Llama-3.x's JSON tool-calling format; anything else is content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # malformed tool-call blocks (kept as content)

    def add(self, other: "Parsed") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        self.errors += other.errors


def _hold_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it might become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _TagSplitter:
    """Splits a text stream into outside / inside segments delimited by `start` and `end` tags."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self.inside = False
        self.buf = ""

    def feed(self, delta: str, final: bool = False) -> list[tuple[bool, str, bool]]:
        """Returns (inside, text, closes) pieces; `closes` marks the end of an inside segment."""
        self.buf += delta
        out = []
        while True:
            tag = self.end if self.inside else self.start
            i = self.buf.find(tag)
            if i >= 0:
                if i or self.inside:
                    out.append((self.inside, self.buf[:i], self.inside))
                self.buf = self.buf[i + len(tag):]
                self.inside = not self.inside
                continue
            keep = 0 if final else _hold_back(self.buf, tag)
            text = self.buf[:len(self.buf) - keep]
            if text:
                out.append((self.inside, text, False))
            self.buf = self.buf[len(self.buf) - keep:]
            return out


class ReasoningParser:
    """`starts_inside`: the prompt already opened the block (chat templates that end with `<think>`), so the
    output is reasoning until `</think>`."""

    def __init__(self, start: str = "<think>", end: str = "</think>", starts_inside: bool = False):
        self.split = _TagSplitter(start, end)
        self.split.inside = starts_inside
        self.result = Parsed()

    def feed(self, delta: str, final: bool = False) -> Parsed:
        """Returns this delta's settled events as a Parsed (content / reasoning deltas)."""
        ev = Parsed()
        for inside, text, _ in self.split.feed(delta, final):
            if inside:
                ev.reasoning += text
            else:
                ev.content += text
        self.result.add(ev)
        return ev

    def finish(self) -> Parsed:
        return self.feed("", final=True)


def _tool_call_from_json(text: str, args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models emit the arguments already serialised
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.split = _TagSplitter(self.START, self.END)
        self.block = ""
        self.result = Parsed()

    def feed(self, delta: str, final: bool = False) -> Parsed:
        ev = Parsed()
        for inside, text, closes in self.split.feed(delta, final):
            if not inside:
                ev.content += text
                continue
            self.block += text
            if closes:
                call = _tool_call_from_json(self.block.strip(), "arguments")
                if call is None:
                    ev.errors.append(f"malformed tool call: {self.block.strip()[:200]}")
                    ev.content += self.START + self.block + self.END
                else:
                    ev.tool_calls.append(call)
                self.block = ""
        if final and self.split.inside:  # an unterminated block: keep it as text, nothing is lost
            ev.content += self.START + self.block
            self.block = ""
            self.split.inside = False
        self.result.add(ev)
        return ev

    def finish(self) -> Parsed:
        return self.feed("", final=True)


class Llama3JsonToolParser:
    """Decides at the first non-space character: `{` or `<|python_tag|>` = a tool call (buffered until the end),
    anything else = content streamed as it comes."""

    TAG = "<|python_tag|>"

    def __init__(self):
        self.mode: str | None = None  # None (undecided), "content", "tool"
        self.buf = ""
        self.result = Parsed()

    def feed(self, delta: str, final: bool = False) -> Parsed:
        ev = Parsed()
        self.buf += delta
        if self.mode is None:
            s = self.buf.lstrip()
            if s.startswith("{") or s.startswith(self.TAG):
                self.mode = "tool"
            elif s and not self.TAG.startswith(s):
                self.mode = "content"
            elif final:
                self.mode = "content"
        if self.mode == "content":
            ev.content, self.buf = self.buf, ""
        elif self.mode == "tool" and final:
            body = self.buf.lstrip()
            body = body[len(self.TAG):] if body.startswith(self.TAG) else body
            calls = [_tool_call_from_json(part, "parameters") for part in _split_json_objects(body)]
            if calls and all(calls):
                ev.tool_calls = calls
            else:
                ev.errors.append(f"malformed tool call: {body[:200]}")
                ev.content = self.buf
            self.buf = ""
        self.result.add(ev)
        return ev

    def finish(self) -> Parsed:
        return self.feed("", final=True)


def _split_json_objects(text: str) -> list[str]:
    """Top-level JSON objects separated by `;` or whitespace (Llama-3 emits several calls joined by `;`)."""
    parts, depth, start, in_str, esc = [], 0, None, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0 and start is not None:
                parts.append(text[start:i + 1])
                start = None
        elif depth == 0 and not ch.isspace() and ch != ";":
            return []  # text between objects: not a pure tool-call answer
    return parts if depth == 0 else []
