"""Server-sent events for a streamed request. The scheduler thread calls each choice's `on_tokens` (tokens ->
incremental detokenizer -> stop-string hold-back -> the event loop's queue) and `on_done` when the choice ends;
the event loop turns queue items into chunks (tool-call deltas through the parser). No thread per sequence: the
loop waits on one queue, and checks for a client gone away every half second."""

from __future__ import annotations

import asyncio

from .detokenize import IncrementalDetokenizer
from .http_errors import generation_error
from .openai_response import Envelope, finish_reason, logprobs_json, new_parser, sse, tool_call_json, usage


class StopHold:
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


class _Choice:
    """One streamed choice: its detokenizer, stop hold-back, tool-call parser and tool calls sent so far."""

    def __init__(self, tok, req):
        self.detok = IncrementalDetokenizer(tok)
        self.hold = StopHold(req.stop)
        plan = req.plan
        self.parser = new_parser(plan.parser) if req.chat and plan is not None and plan.parser else None
        self.called = 0


def stream(server, req, is_disconnected):
    """Submit `req` (serving/openai_request.py) and return the async generator of its SSE lines. Admission
    happens here, before the first byte: a full queue stays an HTTP 429. `is_disconnected`: the request's
    coroutine function that tells whether the client went away."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    tok = server.engine.tokenizer
    env = Envelope(req.chat, server.model_name, stream=True)
    choices = [_Choice(tok, req) for _ in range(req.choices)]

    held: list = []  # the submitted sequences, once `submit` returns

    def on_tokens_of(i):
        def on_tokens(new, lps=None):  # the scheduler thread
            text = choices[i].hold.push(choices[i].detok.push(new))
            spec = None
            if req.include_speculation:  # a chunk per step: its tokens' texts and how many were accepted drafts
                drafts = held[0][i].drafts_in_step if held else len(new) - 1
                spec = {"tokens": [tok.decode([t], skip_special_tokens=False) for t in new], "accepted": drafts}
            if lps is not None or spec is not None:  # a chunk per step: its text (maybe held back: "") and more
                lp = None if lps is None else logprobs_json(tok, req.chat, new, lps)
                loop.call_soon_threadsafe(q.put_nowait, (i, "text", (text, lp, spec)))
            elif text:
                loop.call_soon_threadsafe(q.put_nowait, (i, "text", (text, None)))
            return True
        return on_tokens

    def on_done_of(i):
        return lambda seq: loop.call_soon_threadsafe(q.put_nowait, (i, "done", seq))

    seqs = server.submit(req, [on_tokens_of(i) for i in range(req.choices)],
                         [on_done_of(i) for i in range(req.choices)])
    held.append(seqs)

    def parsed_chunks(i, parsed):
        c = choices[i]
        if parsed.content:
            yield env.chunk(i, text=parsed.content)
        for call in parsed.tool_calls:
            yield env.chunk(i, tool_calls=[tool_call_json(call, c.called, stream=True)])
            c.called += 1

    def text_chunks(i, text, lps=None, spec=None, final=False):
        c = choices[i]
        if c.parser is not None:
            yield from parsed_chunks(i, c.parser.feed(text, final=final))
        elif text or lps is not None or spec is not None:
            yield env.chunk(i, text=text, logprobs=lps, extra=spec)

    async def gen():
        results, left = [], req.choices
        try:
            if req.chat:
                for i in range(req.choices):
                    yield env.chunk(i, role=True)
            elif req.echo:  # completions `echo`: the prompt's text first
                for i in range(req.choices):
                    yield env.chunk(i, text=req.echo[i // req.n])
            while left:
                try:
                    i, kind, val = await asyncio.wait_for(q.get(), 0.5)
                except asyncio.TimeoutError:
                    if await is_disconnected():
                        return
                    continue
                if kind == "text":
                    for line in text_chunks(i, *val):
                        yield line
                    continue
                left -= 1
                seq = val
                if seq.error is not None or seq.result is None:
                    err = generation_error(seq.error if seq.error is not None else RuntimeError("no result"))
                    yield sse(err.body())
                    return
                server.finished(seq)
                for line in text_chunks(i, choices[i].hold.push(choices[i].detok.finish(), final=True), final=True):
                    yield line
                results.append(seq.result)
                yield env.chunk(i, finish=finish_reason(seq.result, choices[i].called > 0))
            if req.include_usage:
                yield env.sse([], usage(req.prompts, results))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): stop and free whatever still runs
            server.cancel(seqs)

    return gen()
