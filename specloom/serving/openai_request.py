"""OpenAI body -> one generation request: the validated pydantic model (serving/schemas.py) is read, not checked
again; only what depends on this server is checked here (the model name, max_tokens against the context, n and
the number of sequences against the pool, token ids against the vocabulary), plus the tool / structured-output
plan (serving/tools.py) and the prompts as token ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecloomError
from .http_errors import APIError
from .schemas import validate_body


@dataclass
class GenerationRequest:
    """What a /v1 request asks for, every field decided. One choice per (prompt, n): choice k = prompt * n + i."""

    chat: bool
    prompts: list[list[int]]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    sampling_rule: str = "auto"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    include_speculation: bool = False  # stream chunks carry the step's tokens and accepted drafts (extension)
    speculate: bool = True
    logprobs: int | None = None  # None: none; else how many alternatives per token
    plan: object | None = None  # serving/tools.py's ToolPlan, or None
    echo: list[str] | None = None  # completions `echo`: each prompt's text, put before its choices' text

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def read_request(body: dict, chat: bool, server) -> GenerationRequest:
    """The request `body` asks for, on `server` (a serving/api.py Server); APIError(4xx) naming the field when
    it cannot be served."""
    m = validate_body(body, chat)
    if m.model not in (None, server.model_name):
        raise APIError(404, f"The model {m.model!r} does not exist (this server serves {server.model_name!r})",
                       "model", "model_not_found")
    ctx = server.engine.max_model_len
    mt_key = "max_completion_tokens" if chat and m.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(m, mt_key)
    if max_tokens is None:
        max_tokens = min(256, ctx - 1)
    elif max_tokens > ctx:
        raise APIError(400, f"{mt_key} must be an integer in [1, {ctx}], got {max_tokens}", mt_key)
    n = 1 if m.n is None else m.n
    if n > server.max_n:
        raise APIError(400, f"n must be an integer in [1, {server.max_n}], got {n}", "n")
    plan = _tool_plan(body, chat, server)
    prompts = [_chat_ids(m, plan, server)] if chat else _completion_ids(m, server)
    req = GenerationRequest(
        chat=chat, prompts=prompts, max_tokens=max_tokens, n=n, seed=m.seed, plan=plan,
        sampling_rule=m.sampling_rule or "auto",
        presence_penalty=float(m.presence_penalty or 0.0), frequency_penalty=float(m.frequency_penalty or 0.0),
        repetition_penalty=1.0 if m.repetition_penalty is None else float(m.repetition_penalty),
        logit_bias=_logit_bias(m, server),
        temperature=1.0 if m.temperature is None else float(m.temperature),
        top_p=1.0 if m.top_p is None else float(m.top_p),
        stop=[m.stop] if isinstance(m.stop, str) else list(m.stop or []),
        stream=m.stream is True,
        include_usage=m.stream_options is not None and m.stream_options.include_usage is True,
        include_speculation=m.stream_options is not None and m.stream_options.include_speculation is True,
        speculate=m.speculate is not False,
        logprobs=_logprobs(m, chat),
        echo=None if chat or not m.echo else _prompt_texts(m, server))
    if req.choices > server.max_n:
        raise APIError(400, f"{len(prompts)} prompts x n={n} is {req.choices} sequences; this server runs at most "
                            f"{server.max_n} at once", "prompt")
    for ids in prompts:
        if len(ids) + max_tokens > ctx:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together they "
                                f"exceed the model's context of {ctx} tokens", "max_tokens")
    return req


def _logit_bias(m, server) -> tuple[tuple[int, float], ...]:
    """logit_bias's token ids, checked against this server's vocabulary."""
    vocab = server.engine.model.config.vocab_size
    out = []
    for key, bias in (m.logit_bias or {}).items():
        if int(key) >= vocab:
            raise APIError(400, f"logit_bias names token id {key}, outside the vocabulary [0, {vocab})", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _logprobs(m, chat: bool) -> int | None:
    """Chat `logprobs: true` + `top_logprobs` (0-20), completions `logprobs: N` (0-5), as OpenAI."""
    if chat:
        return (m.top_logprobs or 0) if m.logprobs else None
    return m.logprobs


def _tool_plan(body: dict, chat: bool, server):
    """The request's tool / structured-output plan (serving/tools.py), or None."""
    if not any(body.get(k) is not None for k in ("tools", "tool_choice", "response_format")):
        return None
    from .tools import ToolRequestError, plan_request

    if not chat and body.get("tools") is not None:
        raise APIError(400, "tools are only supported on /v1/chat/completions", "tools")
    try:
        return plan_request(body, server.engine.tokenizer)
    except ToolRequestError as e:
        raise APIError(400, e.message, e.param) from None


def _refuse_if_too_long(texts: list[str], server, param: str) -> None:
    """A 400 for a prompt that cannot fit the context, found cheaply before the whole text is tokenized (a few MB
    of text make a tokenizer allocate hundreds of MB that the allocator then keeps): only a prefix long enough to
    hold the context is tokenized, and if it alone takes more than the context (plus a margin for the tokens the
    cut could split and the messages' own boundaries) the whole cannot fit. Shorter texts go on as before."""
    ctx, tok = server.engine.max_model_len, server.engine.tokenizer
    if sum(map(len, texts)) <= 4 * ctx:
        return
    limit = (ctx + 1) * tok.max_token_chars
    head = "".join(texts)[:limit]
    n = len(tok.encode(head, special=False))
    if n > ctx + tok.max_token_chars + len(texts):
        raise APIError(400, f"the prompt takes more than {ctx} tokens (its first {len(head)} characters alone take "
                            f"{n}): it cannot fit the model's context of {ctx} tokens", param)


def _chat_ids(m, plan, server) -> list[int]:
    """The chat prompt: content parts keep their text parts; the tool plan's messages when there is one."""
    msgs = plan.messages if plan is not None else [x.model_dump(exclude_unset=True) for x in m.messages]
    clean = []
    for x in msgs:
        c = x.get("content")
        if isinstance(c, list):  # OpenAI content parts: keep the text parts
            c = "".join(p["text"] for p in c if isinstance(p, dict) and p.get("type") == "text"
                        and isinstance(p.get("text"), str))
        clean.append({**{k: v for k, v in x.items() if k != "content"}, "content": c or ""})
    _refuse_if_too_long([x["content"] for x in clean if isinstance(x["content"], str)], server, "messages")
    try:
        kwargs = plan.template_kwargs if plan is not None and plan.template_kwargs else {}
        return server.engine.tokenizer.encode_chat(clean, special_in_content=server.special_tokens_in_input,
                                                   **kwargs)
    except SpecloomError as e:
        raise APIError(400, str(e), "messages") from None


def _prompt_items(m) -> list:
    p = m.prompt
    return p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]


def _prompt_texts(m, server) -> list[str]:
    """Each prompt as `echo` returns it: a text as sent, token ids decoded."""
    return [x if isinstance(x, str) else server.engine.tokenizer.decode(x, skip_special_tokens=False)
            for x in _prompt_items(m)]


def _completion_ids(m, server) -> list[list[int]]:
    """One prompt per text, token-id list or item of a list of either."""
    items = _prompt_items(m)
    vocab = server.engine.model.config.vocab_size
    out = []
    for x in items:
        if isinstance(x, str):
            _refuse_if_too_long([x], server, "prompt")
            out.append(server.engine.tokenizer.encode(x, special=server.special_tokens_in_input))
            continue
        if min(x) < 0 or max(x) >= vocab:
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        out.append(list(x))
    return out
