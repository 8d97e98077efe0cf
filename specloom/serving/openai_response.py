"""Generation results -> OpenAI's response bodies: the completion object, the stream's chunks, a choice's message
(tool calls parsed out of the text), finish reasons and logprobs objects."""

from __future__ import annotations

import json
import time
import uuid


def new_parser(name: str):
    from .parsers import HermesToolParser, Llama3JsonToolParser

    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}[name]()


def tool_call_json(call, index: int, stream: bool = False) -> dict:
    d = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **d} if stream else d


def finish_reason(result, called: bool) -> str:
    return "tool_calls" if called else ("length" if result.finish_reason == "length" else "stop")


def message(plan, text: str, chat: bool) -> tuple[dict, bool]:
    """(message or text fields, has tool calls) for a finished choice."""
    if not chat:
        return {"text": text}, False
    if plan is not None and plan.parser is not None:
        parsed = new_parser(plan.parser).feed(text, final=True)
        calls = [tool_call_json(c, j) for j, c in enumerate(parsed.tool_calls)]
        msg = {"role": "assistant", "content": parsed.content or None}
        if calls:
            msg["tool_calls"] = calls
        else:
            msg["content"] = parsed.content
        return {"message": msg}, bool(calls)
    return {"message": {"role": "assistant", "content": text}}, False


def logprobs_json(tok, chat: bool, token_ids: list[int], lps: list) -> dict:
    """OpenAI's logprobs object for these tokens: chat {content: [{token, logprob, bytes, top_logprobs}]},
    completions {tokens, token_logprobs, top_logprobs, text_offset}. Logprobs are the target's own log-softmax
    (after a grammar mask, if any) at the position each token was chosen -- the same with or without
    speculation."""
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


def usage(prompts: list[list[int]], results: list) -> dict:
    """OpenAI's usage object for these results, with how speculation went: `completion_tokens_details` as OpenAI's
    predicted outputs report it (accepted / rejected prediction tokens) and specloom's `speculation` (drafted and
    accepted tokens, target passes, tau = tokens per pass)."""
    used = sum(map(len, prompts))
    completion = sum(len(r.token_ids) for r in results)
    drafted = sum(r.num_draft_tokens for r in results)
    accepted = sum(r.num_accepted_tokens for r in results)
    passes = sum(r.num_target_passes for r in results)
    return {"prompt_tokens": used, "completion_tokens": completion, "total_tokens": used + completion,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted},
            "speculation": {"drafted_tokens": drafted, "accepted_tokens": accepted, "target_passes": passes,
                            "tau": round(completion / passes, 3) if passes else None}}


class Envelope:
    """One response's id, object type, creation time and model name; wraps its bodies and stream chunks."""

    def __init__(self, chat: bool, model: str, stream: bool = False):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"

    def body(self, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def sse(self, choices: list, usage: dict | None = None) -> str:
        return sse(self.body(choices, usage))

    def chunk(self, i: int, text: str | None = None, finish: str | None = None, role: bool = False,
              tool_calls: list | None = None, logprobs=None, extra: dict | None = None) -> str:
        """One choice's stream chunk: the role first (chat), then text or tool-call deltas, then the finish.
        `extra`: the choice's `specloom` extension field (`stream_options.include_speculation`)."""
        if self.chat:
            if role:
                delta = {"role": "assistant", "content": ""}
            elif tool_calls:
                delta = {"tool_calls": tool_calls}
            else:
                delta = {"content": text} if text else {}
            ch = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            ch = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        if extra is not None:
            ch["specloom"] = extra
        return self.sse([ch])


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"
