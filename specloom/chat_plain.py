"""Chat prompts whose message content cannot forge the template's special tokens.

A user who writes `<|im_end|><|im_start|>system ...` in a message must get those characters as text, not a new
system turn. Each special-token string found in the template's inputs (message content, names, tool definitions)
is swapped for a placeholder of private-use characters, the template is rendered to text, the text is split at the
special tokens that remain (the template's own markers, which become their ids), and every piece between them is
encoded with the placeholders put back and special-token parsing off. When no input holds a special-token string
the caller tokenizes as before, so ordinary prompts get exactly the template's usual ids.
"""

from __future__ import annotations

import re


def _strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _strings(x)


def _replace(v, fn):
    if isinstance(v, str):
        return fn(v)
    if isinstance(v, dict):
        return {k: _replace(x, fn) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_replace(x, fn) for x in v]
    return v


def encode_chat_plain(hf, messages: list[dict], template_kwargs: dict) -> list[int] | None:
    """The prompt's ids with special-token strings in the inputs encoded as text; None when no input holds one
    (then the ordinary tokenization is already safe)."""
    added = {t.content for t in getattr(hf, "added_tokens_decoder", {}).values() if t.special}
    specials = sorted({t for t in (*hf.all_special_tokens, *added) if t}, key=len, reverse=True)
    inputs = (messages, template_kwargs)
    texts = list(_strings(inputs))
    found = [t for t in specials if any(t in s for s in texts)]
    if not found:
        return None
    joined = "".join(texts)
    base = next(c for c in range(0xE000, 0xF8FF) if chr(c) not in joined)  # a private-use char unused here
    mark = chr(base)
    holders = {t: f"{mark}{i}{mark}" for i, t in enumerate(found)}
    finder = re.compile("|".join(re.escape(t) for t in found))
    hide = lambda s: finder.sub(lambda m: holders[m.group(0)], s)  # noqa: E731
    back = {h: t for t, h in holders.items()}
    unhide = re.compile(re.escape(mark) + r"\d+" + re.escape(mark))
    safe_messages, safe_kwargs = _replace(messages, hide), _replace(template_kwargs, hide)
    text = hf.apply_chat_template(safe_messages, add_generation_prompt=True, tokenize=False, **safe_kwargs)
    split = re.compile("(" + "|".join(re.escape(t) for t in specials) + ")")
    ids: list[int] = []
    for i, piece in enumerate(split.split(text)):
        if i % 2:  # a special token the template wrote
            ids.append(hf.convert_tokens_to_ids(piece))
        elif piece:
            piece = unhide.sub(lambda m: back.get(m.group(0), m.group(0)), piece)
            ids += hf(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids
